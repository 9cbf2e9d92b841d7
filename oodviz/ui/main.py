"""The app: five pages (:mod:`oodviz.ui.navigation`) under one top bar — New run, Runs, Run, Compare, Detectors —
each keeping what it shows in its URL, so a reload, another tab or a link comes back to the same view.

The UI only turns choices into a RunConfig and draws runs; everything else is in ``oodviz``.
"""

from __future__ import annotations

import sys
import traceback

import streamlit as st

from oodviz.ui.access import AccessPolicy, show_server_details
from oodviz.ui.navigation import PAGES, page

TOKEN_KEY = "access-token"


def access_granted(policy: AccessPolicy) -> bool:
    """Whether this browser session may use the app: always without a token; else once it has given the
    token, in the URL (``?token=``) or in the prompt drawn here (kept in the session)."""
    if policy.token_ok(st.session_state.get(TOKEN_KEY)):
        return True
    given = st.query_params.get("token")
    if given is not None and policy.token_ok(given):
        st.session_state[TOKEN_KEY] = given
        return True
    st.title("oodviz")
    st.info("This oodviz server needs its access token: the one printed where `oodviz app` was started.")
    with st.form("access-token-form"):
        typed = st.text_input("Access token", type="password")
        entered = st.form_submit_button("Open the app")
    if entered and policy.token_ok(typed):
        st.session_state[TOKEN_KEY] = typed
        st.rerun()
    if entered or given is not None:
        st.error("That is not this server's access token.")
    return False


#: At a 1000 px window: narrower side margins (the first eight result tabs fit on one line), result tabs that
#: wrap rather than scroll out of sight, and multiselect chips in a smaller font, so no name is cut. Less room above
#: the page than Streamlit's 6rem: the top bar (the page links) is 3.75rem high, and the rest was blank.
PAGE_STYLE = """<style>
[data-testid="stMainBlockContainer"] { padding-top: 4.5rem; padding-left: 1.5rem; padding-right: 1.5rem; }
[role="tablist"] { flex-wrap: wrap; column-gap: 0.5rem; }
[data-testid="stMultiSelectTagsContainer"] span { font-size: 0.75rem; }
</style>"""


def main() -> None:
    st.set_page_config(page_title="oodviz", page_icon="🔍", layout="wide")
    st.html(PAGE_STYLE)
    if not access_granted(AccessPolicy.from_env()):
        return
    shown = st.navigation([page(name) for name in PAGES], position="top")
    if shown.url_path == PAGES["new"].url_path and "run" in st.query_params:
        # a link of the single-page app (``/?run=<id>&tab=...``): the run's page, its view kept
        st.switch_page(page("run"), query_params=st.query_params.to_dict())
    try:
        shown.run()
    except Exception as error:  # st.rerun/st.stop/st.switch_page are BaseExceptions and pass through
        if not show_server_details():  # the details go to the server's log, not to another person's page
            traceback.print_exc(file=sys.stderr)
            st.error("Something went wrong. The app is still running; finished runs are kept.")
            return
        st.error(
            f"Something went wrong: {type(error).__name__}: {error}. The app is still running; finished runs are kept."
        )
        with st.expander("Details"):
            st.exception(error)
