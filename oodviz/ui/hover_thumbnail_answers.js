// The on-demand half of oodviz's hover thumbnails (oodviz/ui/hover_thumbnail.py): a Streamlit v2 component in
// a fragment of its own that takes no room. The hover panel (hover_thumbnail.js) asks it, by a window event,
// for the thumbnails of a few drawn rows of its map; it sends them to Python as its `request` trigger value
// (only its fragment reruns) and hands the answer that comes back in `data.answer` to the panel, by a window
// event too. It shows nothing itself.

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
