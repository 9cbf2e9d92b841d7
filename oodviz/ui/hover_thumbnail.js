// The hover panel of oodviz's feature-space map (oodviz/ui/hover_thumbnail.py): a Streamlit v2 component
// that finds the map's plotly chart by its layout.meta and, while the mouse rests on a point, shows beside
// the cursor the point's set, source index, true class and prediction, and its thumbnail. The names and the
// sprite's thumbnails come from `data` (sent by Python once per page run). A point outside the sprite, once
// the mouse has rested on it for DWELL_MS, is asked for with its nearest drawn neighbours without one: a
// window event to hover_thumbnail_answers.js, which asks the server; the answer comes back as an event too
// and is kept for the page's life, so a point is fetched once. Names are set as text (never as HTML): set
// and class names come from the run's config.

const PANEL_CLASS = "oodviz-hover-thumbnail";
const SHOWN_PX = 96;
const DWELL_MS = 120;  // rest on a point this long before its thumbnail is asked for
const RETRY_MS = 5000;  // a request not answered by then may be sent again
const REQUEST_EVENT = "oodviz-hover-thumbnail-request";
const ANSWER_EVENT = "oodviz-hover-thumbnail-answer";
const IMAGE_URL = /^data:image\/webp;base64,[A-Za-z0-9+/=]+$/;
const mounted = new Map();  // frontend key -> cleanup of the instance drawn last (one panel per instance)
const fetchedByMap = new Map();  // data.map_id -> (drawn row -> thumbnail sent on demand), for the page's life
const MAPS_KEPT = 4;

function decode(b64, Type) {
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  return new Type(bytes.buffer);
}

function makePanel() {
  const panel = document.createElement("div");
  panel.className = PANEL_CLASS;
  Object.assign(panel.style, {
    position: "fixed", display: "none", zIndex: "100000", pointerEvents: "none", background: "white",
    border: "1px solid #888", borderRadius: "4px", padding: "4px", font: "12px sans-serif", color: "#222",
    boxShadow: "0 2px 6px rgba(0,0,0,0.25)", maxWidth: "220px",
  });
  const image = document.createElement("img");
  image.width = SHOWN_PX;
  image.height = SHOWN_PX;
  image.alt = "thumbnail of the hovered sample";
  Object.assign(image.style, { imageRendering: "pixelated", display: "block" });
  const caption = document.createElement("div");
  panel.append(image, caption);
  document.body.append(panel);
  return { panel, image, caption };
}

export default function ({ data, key }) {
  if (mounted.has(key)) mounted.get(key)();  // drawn again with new data: replace, never stack, panels
  const sets = data.sets, classes = data.classes;
  const setOf = decode(data.set, Uint8Array), indexOf = decode(data.index, Int32Array);
  const labelOf = decode(data.label, Int16Array), predictionOf = decode(data.prediction, Int16Array);
  const tileOf = new Map();
  let sheet = null;
  if (data.sprite) {
    const positions = decode(data.positions, Int32Array), tiles = decode(data.tiles, Int32Array);
    positions.forEach((p, k) => tileOf.set(p, tiles[k]));
    sheet = new Image();
    sheet.src = data.sprite;
  }
  const tileURLs = new Map();
  if (!fetchedByMap.has(data.map_id)) fetchedByMap.set(data.map_id, new Map());
  const fetched = fetchedByMap.get(data.map_id);  // drawn row -> thumbnail sent on demand (WebP data URL)
  fetchedByMap.delete(data.map_id);  // the map drawn last is kept longest
  fetchedByMap.set(data.map_id, fetched);
  while (fetchedByMap.size > MAPS_KEPT) fetchedByMap.delete(fetchedByMap.keys().next().value);
  const asked = new Map();  // drawn row -> when it was asked for, until answered
  const { panel, image, caption } = makePanel();
  const className = (c) => (c < 0 ? "OOD" : (classes[c] ?? String(c)));
  let hovered = -1, dwell = null, xs = null, ys = null;

  function tileURL(tile) {  // one tile of the sprite as its own PNG data URL (cached)
    if (!tileURLs.has(tile)) {
      const size = data.size, canvas = document.createElement("canvas");
      canvas.width = size;
      canvas.height = size;
      const x = (tile % data.columns) * size, y = Math.floor(tile / data.columns) * size;
      canvas.getContext("2d").drawImage(sheet, x, y, size, size, 0, 0, size, size);
      tileURLs.set(tile, canvas.toDataURL("image/png"));
    }
    return tileURLs.get(tile);
  }

  function show(row) {  // the panel's image and caption for `row`, from the sprite, an answer or neither yet
    const tile = tileOf.get(row);
    const inSprite = tile !== undefined && sheet && sheet.complete && sheet.naturalWidth > 0;
    const url = inSprite ? tileURL(tile) : fetched.get(row);
    image.style.display = url ? "block" : "none";
    if (url && image.getAttribute("src") !== url) image.src = url;
    panel.dataset.row = String(row);
    panel.dataset.tile = tile === undefined ? "" : String(tile);
    panel.dataset.source = inSprite ? "sprite" : (url ? "server" : "");
    caption.textContent = `${sets[setOf[row]]} #${indexOf[row]} · true ${className(labelOf[row])} · ` +
      `predicted ${className(predictionOf[row])}` + (url ? "" : " (thumbnail loading)");
  }

  function wanted(row) {  // not in the sprite, not answered, not asked for in the last RETRY_MS
    return !tileOf.has(row) && !fetched.has(row) && !(performance.now() - (asked.get(row) ?? -Infinity) < RETRY_MS);
  }

  function pointsXY() {  // each drawn row's x and y, from the chart's traces (customdata: the drawn row)
    xs = new Float64Array(indexOf.length).fill(NaN);
    ys = new Float64Array(indexOf.length).fill(NaN);
    for (const trace of chart._fullData || chart.data || []) {
      const rows = trace.customdata, x = trace.x, y = trace.y;
      if (!rows || !x || !y) continue;
      for (let k = 0; k < rows.length; k++) {
        const row = Number(Array.isArray(rows[k]) ? rows[k][0] : rows[k]);
        if (row >= 0 && row < xs.length) { xs[row] = x[k]; ys[row] = y[k]; }
      }
    }
  }

  function neighbours(row, count) {  // the `count` nearest wanted rows to `row` on screen (axes' spans as units)
    if (count <= 0 || !chart) return [];
    if (!xs) pointsXY();
    const layout = chart._fullLayout || {};
    const span = (axis) => (axis && axis.range ? Math.abs(axis.range[1] - axis.range[0]) || 1 : 1);
    const sx = span(layout.xaxis), sy = span(layout.yaxis);
    const best = [];  // [distance, row], nearest first
    for (let k = 0; k < xs.length; k++) {
      if (k === row || !wanted(k)) continue;
      const d = ((xs[k] - xs[row]) / sx) ** 2 + ((ys[k] - ys[row]) / sy) ** 2;
      if (!(d >= 0) || (best.length === count && d >= best[count - 1][0])) continue;
      let at = best.length === count ? count - 1 : best.length;
      while (at > 0 && best[at - 1][0] > d) { best[at] = best[at - 1]; at--; }
      best[at] = [d, k];
    }
    return best.map(([, k]) => k);
  }

  function ask(row) {
    if (row !== hovered || !wanted(row)) return;
    const rows = [row, ...neighbours(row, (data.answer_tiles || 1) - 1)];
    const now = performance.now();
    rows.forEach((r) => asked.set(r, now));
    window.dispatchEvent(new CustomEvent(REQUEST_EVENT, { detail: { meta: data.meta, rows } }));
  }

  function onAnswer(event) {
    const answer = event.detail || {};
    if (answer.meta !== data.meta || !Array.isArray(answer.rows) || !Array.isArray(answer.images)) return;
    answer.rows.forEach((row, k) => {
      const url = answer.images[k];
      if (Number.isInteger(row) && row >= 0 && row < indexOf.length && typeof url === "string" && IMAGE_URL.test(url)) {
        fetched.set(row, url);
        asked.delete(row);
      }
    });
    if (hovered >= 0 && fetched.has(hovered) && panel.style.display !== "none") show(hovered);
  }

  function onHover(event) {
    const point = event.points && event.points[0];
    if (!point || point.customdata === undefined) return;
    const row = Number(Array.isArray(point.customdata) ? point.customdata[0] : point.customdata);
    if (!(row >= 0 && row < indexOf.length)) return;
    hovered = row;
    show(row);
    clearTimeout(dwell);
    if (wanted(row)) dwell = setTimeout(() => ask(row), DWELL_MS);
    const mouse = event.event || {};
    const x = (mouse.clientX ?? 0) + 16, y = (mouse.clientY ?? 0) + 16;
    panel.style.display = "block";
    panel.style.left = `${Math.min(x, window.innerWidth - panel.offsetWidth - 8)}px`;
    panel.style.top = `${Math.min(y, window.innerHeight - panel.offsetHeight - 8)}px`;
  }

  function onUnhover() {
    panel.style.display = "none";
    hovered = -1;
    clearTimeout(dwell);
  }

  let chart = null;
  function attach() {  // the chart may be drawn after this component, or drawn anew by a rerun
    const found = [...document.querySelectorAll(".js-plotly-plot")].find((gd) => gd.layout && gd.layout.meta === data.meta);
    if (found === chart || !found || typeof found.on !== "function") return;
    detach();
    chart = found;
    xs = ys = null;  // a new drawing: read the points' coordinates again when needed
    chart.on("plotly_hover", onHover);
    chart.on("plotly_unhover", onUnhover);
  }
  function detach() {
    if (chart && typeof chart.removeListener === "function") {
      chart.removeListener("plotly_hover", onHover);
      chart.removeListener("plotly_unhover", onUnhover);
    }
    chart = null;
  }
  attach();
  const timer = setInterval(attach, 500);
  window.addEventListener(ANSWER_EVENT, onAnswer);
  const cleanup = () => {
    clearInterval(timer);
    clearTimeout(dwell);
    window.removeEventListener(ANSWER_EVENT, onAnswer);
    detach();
    panel.remove();
    if (mounted.get(key) === cleanup) mounted.delete(key);
  };
  mounted.set(key, cleanup);
  return cleanup;
}
