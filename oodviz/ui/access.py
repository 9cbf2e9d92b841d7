"""Who may use the app and which server paths a browser user may name (no streamlit here: unit-testable).

``oodviz app`` builds an :class:`AccessPolicy` from its options and hands it to the Streamlit process
in environment variables (:meth:`AccessPolicy.to_env`); the page reads it back (:meth:`AccessPolicy.from_env`)
and enforces it before it draws anything:

- On loopback (the default) nobody else can connect: no token, no confinement, full error details.
- Serving others (``--host`` not a loopback address) needs the access token, hides tracebacks and
  server paths, and confines every path typed in the page to the ``--data-dir`` directories.
- Streamlit refuses a websocket whose ``Host`` header is not one of ``allowed_hosts`` (``server.allowedHosts``:
  DNS rebinding), and :mod:`oodviz.ui.serve` one from another origin than the app's own.

The run named in the URL (``?run=``) must be a direct child of the runs root: :func:`run_path`.
"""

from __future__ import annotations

import copy
import hmac
import ipaddress
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from oodviz.config.plan import cut_paths

if TYPE_CHECKING:  # no torch at import: ``oodviz app`` reads the policy before it execs Streamlit
    from oodviz.config.run import RunConfig

ENV_TOKEN = "OODVIZ_ACCESS_TOKEN"
ENV_SERVE_OTHERS = "OODVIZ_SERVE_OTHERS"
ENV_DATA_DIRS = "OODVIZ_DATA_DIRS"  # os.pathsep-separated; unset = no confinement
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
#: Dataset sources that read (or download into) the data root; the others ignore it.
DATA_ROOT_SOURCES = ("torchvision", "openood")
NOT_ALLOWED = "folder not under an allowed data directory"


class PathRefused(ValueError):
    """A path typed in the page that the policy does not allow; the message names no server path. ``refused``:
    ``(field label, why)`` of each refused path, for a form to show each under its field."""

    def __init__(self, message: str, refused: tuple[tuple[str, str], ...] = ()):
        super().__init__(message)
        self.refused = tuple(refused)


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` serves this machine only (``localhost``, ``127.0.0.0/8``, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def machine_host_names() -> list[str]:
    """The names and addresses browsers may use to reach this machine: loopback, its host names and
    the addresses of its interfaces."""
    import psutil

    names = [*LOOPBACK_HOSTS, socket.gethostname(), socket.getfqdn()]
    for addresses in psutil.net_if_addrs().values():
        names += [a.address.split("%")[0] for a in addresses if a.family in (socket.AF_INET, socket.AF_INET6)]
    return list(dict.fromkeys(n.lower() for n in names if n))


@dataclass(frozen=True)
class AccessPolicy:
    """The access rules of one app server.

    - ``token``: the access token a browser must give (``None``: no gate).
    - ``serve_others``: the server listens beyond loopback: hide tracebacks and server paths.
    - ``data_dirs``: resolved directories typed paths must lie under (``None``: no confinement).
    - ``allowed_hosts``: host names the ``Host`` header may carry (Streamlit's ``server.allowedHosts``; the
      server process enforces it, so it does not travel in the environment).
    """

    token: str | None = None
    serve_others: bool = False
    data_dirs: tuple[Path, ...] | None = None
    allowed_hosts: tuple[str, ...] = ()

    @classmethod
    def from_env(cls, env=None) -> AccessPolicy:
        env = os.environ if env is None else env
        dirs = env.get(ENV_DATA_DIRS)
        return cls(
            token=env.get(ENV_TOKEN) or None,
            serve_others=env.get(ENV_SERVE_OTHERS) == "1",
            data_dirs=None if dirs is None else tuple(Path(d) for d in dirs.split(os.pathsep) if d),
        )

    def to_env(self) -> dict[str, str]:
        env = {ENV_SERVE_OTHERS: "1" if self.serve_others else "0"}
        if self.token:
            env[ENV_TOKEN] = self.token
        if self.data_dirs is not None:
            env[ENV_DATA_DIRS] = os.pathsep.join(str(d) for d in self.data_dirs)
        return env

    def token_ok(self, given: str | None) -> bool:
        """Whether ``given`` opens the app (always, without a token); compared in constant time."""
        if self.token is None:
            return True
        return given is not None and hmac.compare_digest(given.encode(), self.token.encode())

    def confine(self, typed: str) -> str:
        """The path a browser user typed as the server will use it: unchanged without confinement, else
        resolved (links followed) and required to lie under a data directory. A relative path is taken
        under the first data directory where it exists (else the first one). Raises :class:`PathRefused`."""
        if self.data_dirs is None or not typed.strip():  # nothing typed: the config's own checks say so
            return typed
        path = Path(os.path.expanduser(typed.strip()))
        if not path.is_absolute():
            candidates = [d / path for d in self.data_dirs]
            path = next((c for c in candidates if c.exists()), candidates[0] if candidates else path)
        resolved = path.resolve()
        if not any(resolved.is_relative_to(d) for d in self.data_dirs):
            raise PathRefused(NOT_ALLOWED)
        return str(resolved)

    def confine_config(self, config: RunConfig) -> RunConfig:
        """``config`` with every typed path confined (image folders, checkpoint, and the data root where a
        dataset reads it). Raises :class:`PathRefused` naming each refused field, all at once."""
        if self.data_dirs is None:
            return config
        from oodviz.data import available_datasets, dataset_info

        confined, refused = copy.deepcopy(config), []

        def check(label: str, typed: str) -> str:
            try:
                return self.confine(typed)
            except PathRefused as error:
                refused.append((label, str(error)))
                return typed

        splits = [("ID fit", confined.id_fit), ("ID test", confined.id_test), *[("OOD", c) for c in confined.ood]]
        validation = (("ID validation", confined.id_val), ("OOD validation", confined.ood_val))
        splits += [(label, choice) for label, choice in validation if choice is not None]
        for label, choice in splits:
            if "path" in choice.params:
                choice.params["path"] = check(f"{label} folder", str(choice.params["path"]))
        if confined.checkpoint:
            confined.checkpoint = check("checkpoint", confined.checkpoint)
        known = set(available_datasets())
        sources = {dataset_info(c.name).source for _, c in splits if c.name in known}
        if confined.download or sources & set(DATA_ROOT_SOURCES):
            confined.data_root = check("data root", confined.data_root)
        if refused:
            allowed = "" if self.data_dirs else " (none were named when the app was started: only the bundled data)"
            raise PathRefused(
                "; ".join(f"{label}: {why}" for label, why in refused) + allowed,
                tuple((label, why + allowed) for label, why in refused),
            )
        return confined


def run_path(runs_root: Path, run_id: str) -> Path:
    """The directory of run ``run_id``: a direct child of ``runs_root`` (it may not exist yet).

    Refuses (:class:`PathRefused`, naming no server path) ``.``/``..``, absolute paths, names with a
    separator or a NUL, and a link whose target lies outside the runs root."""
    bad = not run_id or run_id in (".", "..") or "\x00" in run_id or os.path.isabs(run_id)
    if bad or any(sep and sep in run_id for sep in ("/", "\\", os.sep, os.altsep)):
        raise PathRefused("not a run name: a run is named by its folder in the runs root, without any path")
    path = runs_root / run_id
    if path.is_symlink() or path.exists():
        if path.resolve().parent != runs_root.resolve():
            raise PathRefused("this run's folder leads outside the runs root")
    return path


def show_server_details() -> bool:
    """Whether the page may show tracebacks and server paths (not when serving others)."""
    return not AccessPolicy.from_env().serve_others


def shown_message(text: str) -> str:
    """``text`` as the page may show it: as it is on loopback, its server paths cut
    (:func:`oodviz.config.plan.cut_paths`) when serving others."""
    return text if show_server_details() else cut_paths(text)
