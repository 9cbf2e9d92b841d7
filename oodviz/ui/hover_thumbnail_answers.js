// Relays hover_thumbnail.js's requests to Python and its answers back (see oodviz/ui/hover_thumbnail.py).
// Kept short: Streamlit sends this source with every answer.

const REQUEST_EVENT = "oodviz-hover-thumbnail-request";
const ANSWER_EVENT = "oodviz-hover-thumbnail-answer";
const mounted = new Map();  // frontend key -> cleanup of the instance drawn last

export default function ({ data, key, setTriggerValue }) {
  if (mounted.has(key)) mounted.get(key)();  // drawn again with new data: one listener, never stacked
  const onRequest = (event) => {
    const asked = event.detail || {};
    if (asked.meta === data.meta && Array.isArray(asked.rows)) setTriggerValue("request", { rows: asked.rows });
  };
  window.addEventListener(REQUEST_EVENT, onRequest);
  if (data.answer) {
    window.dispatchEvent(new CustomEvent(ANSWER_EVENT, { detail: { meta: data.meta, ...data.answer } }));
  }
  const cleanup = () => {
    window.removeEventListener(REQUEST_EVENT, onRequest);
    if (mounted.get(key) === cleanup) mounted.delete(key);
  };
  mounted.set(key, cleanup);
  return cleanup;
}
