// The record browser's page: plain JavaScript, no framework, no build step. It asks its own server for JSON
// (`record_browser.py`), or, in a one-episode file, reads the bundle inlined in the page. Every text from a record is
// set as text (never as HTML), so a record cannot put markup or script into the page.
"use strict";

const bundleNode = document.getElementById("tito-bundle");
const BUNDLE = bundleNode ? JSON.parse(bundleNode.textContent) : null;
const CALL_LANES = ["main", "compaction", "subagent", "side"];
const main = document.getElementById("main");

async function api(path, params) {
  if (BUNDLE) return fromBundle(path, params || {});
  const query = params ? "?" + new URLSearchParams(params).toString() : "";
  const response = await fetch(path + query);
  const body = await response.json();
  if (!response.ok) throw new Error(body.error ? body.error.message : response.statusText);
  return body;
}

function fromBundle(path, params) {
  if (path === "/api/episode") return BUNDLE.episode;
  if (path === "/api/group") return BUNDLE.group;
  if (path === "/api/turn") {
    const found = BUNDLE.turns[params.session + "/" + params.turn];
    if (!found) throw new Error("this file holds one episode: turn " + params.turn + " is not in it");
    return found;
  }
  throw new Error("this file holds one episode only");
}

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "onclick" || key === "onchange" || key === "oninput") node.addEventListener(key.slice(2), value);
    else if (key === "dataset") Object.assign(node.dataset, value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function svg(tag, attrs, ...children) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined) continue;
    if (key === "onclick") node.addEventListener("click", value);
    else node.setAttribute(key, String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

const enc = encodeURIComponent;
const link = (href, text, attrs) => el("a", { href, ...(attrs || {}) }, text);
const episodeLink = (id) => link("#/episode/" + enc(id), id, { class: "episode-link" });
const turnLink = (session, turn, text) => link("#/turn/" + enc(session) + "/" + turn, text || "turn " + turn);
const groupLink = (id) => link("#/group/" + enc(id), id, { class: "group-link" });
const fmt = (value, digits) => (value === null || value === undefined ? "–" : typeof value === "number" && digits !== undefined ? value.toFixed(digits) : String(value));
const when = (ts) => (ts ? new Date(ts * 1000).toISOString().replace("T", " ").slice(0, 19) : "–");
const callPill = (call, text) => el("span", { class: "pill call call-" + call }, text || call);

function show(...children) {
  main.replaceChildren(...children.flat(Infinity).filter((c) => c !== null && c !== undefined && c !== false));
}

function setWhere(text) {
  document.getElementById("where").textContent = text;
}

function fail(error) {
  show(el("p", { class: "error", id: "error" }, String(error.message || error)));
}

function skippedBanner(skipped) {
  const said = [];
  if (skipped.foreign.length) said.push("not session files, not read: " + skipped.foreign.join(", "));
  for (const torn of skipped.torn_lines) said.push(torn.file + ": " + torn.lines + " unreadable line(s) skipped");
  for (const bad of skipped.unreadable) said.push(bad.file + ": not read (" + bad.error + ")");
  if (!said.length) return null;
  return el("div", { class: "skipped", id: "skipped" }, el("strong", {}, "Skipped. "), said.join(" · "));
}

// -- the rollout table ---------------------------------------------------------------------------------------------

const FILTERS = [
  ["text", "episode or session", "text"], ["reward_min", "reward ≥", "number"], ["reward_max", "reward ≤", "number"],
  ["length_min", "length ≥", "number"], ["length_max", "length ≤", "number"], ["group", "group", "groups"],
  ["label", "label", "labels"], ["call", "call kind", "calls"], ["weight_version", "weights", "weight_versions"],
  ["family", "model family", "families"],
];
const COLUMNS = [
  ["episode", "episode"], ["group", "group"], ["reward", "reward"], [null, "labels"], ["segments", "segments"],
  ["turns", "turns"], ["sampled_tokens", "sampled"], ["length", "length"], [null, "weights"], [null, "family"],
  [null, "closed"], ["first_at", "started"],
];

async function episodesView(params) {
  const query = Object.fromEntries(params);
  const data = await api("/api/episodes", query);
  setWhere(data.record_dir);
  const form = el("form", { class: "filters", id: "filters" });
  for (const [name, label, kind] of FILTERS) {
    let input;
    if (kind === "text" || kind === "number") {
      input = el("input", { name, type: kind, step: kind === "number" ? "any" : null, value: query[name] || "" });
    } else {
      input = el("select", { name }, el("option", { value: "" }, "any"),
        data.facets[kind].map((v) => el("option", { value: v, selected: query[name] === v }, v)));
    }
    input.addEventListener("change", () => applyFilters(form, query));
    form.append(el("label", {}, label, input));
  }
  form.addEventListener("submit", (event) => { event.preventDefault(); applyFilters(form, query); });
  const sort = query.sort || "first_at";
  const order = query.order || "asc";
  const head = el("tr", {}, COLUMNS.map(([key, label]) => {
    const cls = key === sort ? "sorted-" + order : null;
    return el("th", { class: cls, dataset: key ? { sort: key } : {}, onclick: key ? () => {
      const next = new URLSearchParams(params);
      next.set("sort", key);
      next.set("order", key === sort && order === "asc" ? "desc" : "asc");
      next.delete("offset");
      location.hash = "#/?" + next.toString();
    } : null }, label);
  }));
  const maxLength = Math.max(1, ...data.episodes.map((row) => row.length));
  const body = el("tbody", {}, data.episodes.map((row) => el("tr", { dataset: { episode: row.episode } },
    el("td", {}, episodeLink(row.episode), row.sessions.length > 1 || row.sessions[0] !== row.episode
      ? el("div", { class: "facts" }, row.sessions.length + " session(s)") : null),
    el("td", {}, groupLink(row.group)),
    el("td", { class: "num reward" }, fmt(row.reward, 3)),
    el("td", {}, row.labels.map((label) => el("span", { class: "pill" }, label))),
    el("td", {}, Object.entries(row.calls).map(([call, n]) => callPill(call, call + " " + n))),
    el("td", { class: "num" }, row.turns),
    el("td", { class: "num" }, row.sampled_tokens),
    el("td", { class: "num length" }, row.length, el("span", { class: "bar", style: "width:" + Math.round(60 * row.length / maxLength) + "px" })),
    el("td", {}, row.weight_versions.join(", ") || "–"),
    el("td", {}, row.families.join(", ")),
    el("td", {}, row.closed ? "yes" : "open"),
    el("td", {}, when(row.first_at)))));
  const shown = data.offset + data.episodes.length;
  const more = shown < data.matched ? el("button", { id: "more", onclick: () => {
    const next = new URLSearchParams(params);
    next.set("offset", String(shown));
    location.hash = "#/?" + next.toString();
  } }, "next " + Math.min(500, data.matched - shown)) : null;
  show(
    el("h1", {}, "Episodes"),
    skippedBanner(data.skipped),
    el("p", { class: "facts", id: "counts" }, data.matched + " of " + data.total + " episodes match · " + data.sessions +
      " sessions · " + data.turns + " turns" + (data.offset ? " · from row " + (data.offset + 1) : "")),
    form,
    el("table", { class: "rows", id: "episodes" }, el("thead", {}, head), body),
    more);
}

function applyFilters(form, query) {
  const next = new URLSearchParams();
  for (const [name, value] of new FormData(form).entries()) if (value !== "") next.set(name, value);
  for (const key of ["sort", "order"]) if (query[key]) next.set(key, query[key]);
  location.hash = "#/?" + next.toString();
}

// -- sessions, as the control API lists them -----------------------------------------------------------------------

async function sessionsView() {
  const data = await api("/api/sessions");
  const rows = data.sessions.map((row) => el("tr", { dataset: { session: row.session_id } },
    el("td", {}, row.session_id),
    el("td", { class: "num" }, row.turns), el("td", { class: "num" }, row.tokens), el("td", { class: "num" }, row.branches),
    el("td", {}, when(row.last_activity)), el("td", {}, row.closed || "open"),
    el("td", { class: "num" }, row.annotation_count), el("td", { class: "num" }, row.resumed_turns),
    el("td", {}, row.episodes.map((e) => [episodeLink(e), " "]))));
  const head = ["session", "turns", "tokens", "branches", "last activity", "closed", "annotations", "resumed", "episodes"];
  show(el("h1", {}, "Sessions"), skippedBanner(data.skipped),
    el("p", { class: "facts", id: "counts" }, data.sessions.length + " sessions, most recently active first (as GET /v1/sessions lists them)"),
    el("table", { class: "rows", id: "sessions" }, el("thead", {}, el("tr", {}, head.map((h) => el("th", {}, h)))), el("tbody", {}, rows)));
}

// -- an episode: its segments as a graph, each session's tree ------------------------------------------------------

async function episodeView(episode) {
  const data = await api("/api/episode", { id: episode });
  setWhere("episode " + data.episode);
  const row = data.row;
  const facts = el("p", { class: "facts", id: "episode-facts" },
    "reward " + fmt(data.reward, 3) + " · group ", groupLink(data.group), " · " + data.segments.length + " segments · " +
    row.turns + " turns · " + row.sampled_tokens + " sampled tokens · labels " + (data.labels.join(", ") || "none"));
  const legend = el("p", { class: "legend" }, CALL_LANES.map((call) => callPill(call)),
    el("span", {}, "── extends a turn of another segment"), el("span", { style: "color:#cf222e" }, "╌╌ follows (summary, sub-agent spawn)"),
    el("span", { style: "color:#fb8f44" }, "◯ ringed: has siblings (branches, GRPO samples)"));
  const said = data.links.map((l) => el("li", { class: "link-said", dataset: { kind: l.kind, from: l.from, to: l.to } },
    "segment " + l.to + " " + l.kind + " " + (l.kind === "follows" ? "session " + l.session + " turn " + l.turn + " (by " + l.how +
    (l.tool_call_id ? ", tool call " + l.tool_call_id : "") + ")" + (l.from === null ? ", outside this episode" : ", in segment " + l.from)
    : "turn " + l.turn + " of segment " + l.from)));
  const segmentRows = data.segments.map((s) => el("tr", { dataset: { segment: s.index, call: s.call } },
    el("td", { class: "num" }, s.index), el("td", {}, callPill(s.call)), el("td", {}, s.session),
    el("td", {}, s.turns.length + " (" + s.turns[0] + "…" + s.turns[s.turns.length - 1] + ")"),
    el("td", { class: "num" }, s.length), el("td", { class: "num" }, s.sampled_tokens), el("td", { class: "num" }, fmt(s.reward, 3)),
    el("td", {}, turnLink(s.session, s.leaf, "last turn " + s.leaf), BUNDLE ? null : [" · ",
      link("/audit?session=" + enc(s.session) + "&leaf=" + s.leaf, "drift audit", { class: "audit-link", target: "_blank" })])));
  show(
    el("h1", {}, "Episode " + data.episode), facts, legend,
    el("div", { id: "graph" }, segmentGraph(data)),
    el("ul", { id: "links" }, said),
    el("table", { class: "rows", id: "segments" }, el("thead", {}, el("tr", {},
      ["#", "call", "session", "turns", "length", "sampled", "reward", ""].map((h) => el("th", {}, h)))), el("tbody", {}, segmentRows)),
    el("h2", {}, "Session trees"),
    data.trees.map((tree) => el("div", { class: "tree", dataset: { session: tree.session } },
      el("p", { class: "facts" }, "session " + tree.session + " · " + tree.turns.length + " turns of this episode"), sessionTree(tree))));
}

function segmentGraph(data) {
  const width = 200, height = 60, gapX = 40, gapY = 34;
  const lanes = CALL_LANES.filter((call) => data.segments.some((s) => s.call === call));
  const place = {};
  data.segments.forEach((s, k) => {
    place[s.index] = { x: 20 + k * (width + gapX), y: 20 + lanes.indexOf(s.call) * (height + gapY) };
  });
  const total = { w: 40 + data.segments.length * (width + gapX), h: 40 + lanes.length * (height + gapY) };
  const edges = data.links.filter((l) => l.from !== null && place[l.from] && place[l.to]).map((l) => {
    const a = place[l.from], b = place[l.to];
    const x1 = a.x + width, y1 = a.y + height / 2, x2 = b.x, y2 = b.y + height / 2;
    const mid = (x1 + x2) / 2;
    return svg("g", {}, svg("path", { class: "link " + l.kind, "data-kind": l.kind, "data-from": l.from, "data-to": l.to,
      d: `M${x1},${y1} C${mid},${y1} ${mid},${y2} ${x2},${y2}` }),
      l.kind === "follows" ? svg("text", { class: "link-label", x: mid - 20, y: (y1 + y2) / 2 - 4 }, l.how) : null);
  });
  const boxes = data.segments.map((s) => {
    const p = place[s.index];
    return svg("g", { class: "segment call-" + s.call, "data-index": s.index, "data-call": s.call, transform: `translate(${p.x},${p.y})`,
      onclick: () => { location.hash = "#/turn/" + enc(s.session) + "/" + s.turns[0]; } },
      svg("rect", { width, height }),
      svg("text", { class: "title", x: 8, y: 18 }, "#" + s.index + " " + s.call),
      svg("text", { x: 8, y: 36 }, s.turns.length + " turns · " + s.length + " tokens"),
      svg("text", { x: 8, y: 52 }, "session " + s.session.slice(0, 22) + (s.reward !== null ? " · r " + fmt(s.reward, 2) : "")));
  });
  return svg("svg", { width: total.w, height: total.h, id: "segment-graph", role: "img" }, edges, boxes);
}

function sessionTree(tree) {
  // A turn a row, in depth-first order, as `git log --graph` draws history: a run of turns goes straight down its
  // column, and each further child of a turn (a branch, another sample) opens a column of its own. A 3,000-turn agent
  // episode is then a long column to scroll, not a line 3,000 steps wide.
  const children = {};
  for (const node of tree.turns) (children[node.parent] = children[node.parent] || []).push(node);
  const byId = Object.fromEntries(tree.turns.map((n) => [n.turn_id, n]));
  const roots = tree.turns.filter((n) => n.parent === null || !byId[n.parent]);
  const place = {};
  let row = 0;
  let columns = roots.length;  // each root its own column
  const stack = roots.map((n, k) => [n, k]).reverse();
  while (stack.length) {  // iterative: a chain of thousands of turns does not overflow the call stack
    const [node, column] = stack.pop();
    place[node.turn_id] = { x: 20 + column * 22, y: 16 + row * 22 };
    row += 1;
    const kids = children[node.turn_id] || [];
    const placed = kids.map((kid, k) => [kid, k === 0 ? column : columns++]);
    for (const entry of placed.reverse()) stack.push(entry);
  }
  const edges = tree.turns.filter((n) => n.parent !== null && place[n.parent]).map((n) => {
    const a = place[n.parent], b = place[n.turn_id];
    return svg("path", { class: "tree-edge", d: a.x === b.x ? `M${a.x},${a.y} L${b.x},${b.y}` : `M${a.x},${a.y} L${b.x},${a.y + 11} L${b.x},${b.y}` });
  });
  const labelX = 28 + columns * 22;
  const nodes = tree.turns.map((n) => {
    const p = place[n.turn_id];
    const title = "turn " + n.turn_id + " · " + n.call + " · segment " + n.segment + " · prompt " + n.prompt_len +
      " (+" + n.added + ") · sampled " + n.sampled + " · " + (n.finish_reason || "–") + (n.weight_version ? " · weights " + n.weight_version : "") +
      (n.siblings.length ? " · siblings " + n.siblings.join(", ") : "");
    return svg("g", { class: "tree-node call-" + n.call + (n.siblings.length ? " sibling" : ""), "data-turn": n.turn_id,
      "data-segment": n.segment, transform: `translate(${p.x},${p.y})`,
      onclick: () => { location.hash = "#/turn/" + enc(tree.session) + "/" + n.turn_id; } },
      svg("title", {}, title), svg("circle", { r: 7 }),
      svg("text", { x: labelX - p.x, y: 4 }, "turn " + n.turn_id + " · " + n.call + " · +" + n.added + " prompt, " + n.sampled +
        " sampled · " + (n.finish_reason || "–") + (n.siblings.length ? " · siblings " + n.siblings.join(", ") : "")));
  });
  return svg("svg", { width: labelX + 420, height: 24 + row * 22, class: "session-tree" }, edges, nodes);
}

// -- a turn's tokens -----------------------------------------------------------------------------------------------

function shadeOf(logprob) {
  const probability = Math.exp(logprob);
  return "rgba(255, 196, 0, " + (0.15 + 0.75 * (1 - probability)).toFixed(3) + ")";
}

// A prompt run of one special token at least this long is one element (turn_tokens.RUN_SHOWN_WHOLE): an image's
// hundreds of pads, shown with the image they stand for.
const RUN_SHOWN_WHOLE = 8;

function imageSource(name) {
  if (!BUNDLE) return "/image/" + name;
  return (BUNDLE.images || {})[name] || null;
}

function imageFigure(image) {
  const name = image.sha256 + "." + image.format;
  const src = imageSource(name);
  const caption = "image " + image.sha256.slice(0, 12) + " · " + image.width + "×" + image.height + " " + image.format +
    " · " + image.length + " tokens at " + image.offset + "–" + (image.offset + image.length - 1) +
    (src ? "" : " · not in this file");
  return el("figure", { class: "turn-image", "data-sha256": image.sha256 },
    src ? el("img", { src, alt: caption, title: caption }) : null, el("figcaption", {}, caption));
}

function tokenRun(run, sampled, turnVersion, images) {
  const special = new Set(run.special);
  const imageAt = new Map((images || []).map((image) => [image.offset, image]));
  const out = [];
  for (let k = 0; k < run.ids.length; k++) {
    const id = run.ids[k];
    if (!sampled && special.has(k)) {
      let end = k;
      while (end < run.ids.length && run.ids[end] === id) end++;
      if (end - k >= RUN_SHOWN_WHOLE) {
        const image = imageAt.get(run.start + k);
        if (image) out.push(imageFigure(image));
        const text = run.texts ? run.texts[k] : "⟨" + id + "⟩";
        out.push(el("span", { class: "tok prompt special run", "data-id": id, "data-pos": run.start + k,
          "data-count": end - k, title: "id " + id + " × " + (end - k) + " · positions " + (run.start + k) + "–" +
          (run.start + end - 1) }, text + " × " + (end - k)));
        k = end - 1;
        continue;
      }
    }
    out.push(tokenSpan(run, sampled, turnVersion, special, k));
  }
  return out;
}

function tokenSpan(run, sampled, turnVersion, special, k) {
  const id = run.ids[k];
  const text = run.texts ? run.texts[k] : "⟨" + id + "⟩";
  const attrs = { class: "tok " + (sampled ? "sampled" : "prompt") + (special.has(k) ? " special" : ""),
    "data-id": id, "data-pos": run.start + k };
  let title = "id " + id + " · position " + (run.start + k);
  if (sampled) {
    const logprob = run.logprobs[k];
    attrs["data-logprob"] = logprob;
    attrs.style = "background:" + shadeOf(logprob);
    title += " · log-prob " + logprob.toFixed(4) + " · p " + Math.exp(logprob).toFixed(3);
    const version = run.weight_versions ? run.weight_versions[k] : null;
    if (version !== null && version !== undefined) {
      attrs["data-weight"] = version;
      title += " · weights " + version + (version !== turnVersion ? " (not the turn's last)" : "");
    }
  }
  attrs.title = title;
  return el("span", attrs, text.replace(/\n/g, "↵\n"));
}

// A content part as text; an image part (a record line names it by digest) as the digest its drawing has above.
function partText(part) {
  if (part && typeof part.text === "string") return part.text;
  if (part && part.type === "image" && typeof part.sha256 === "string") {
    return "[image " + part.sha256.slice(0, 12) + " " + part.width + "×" + part.height + "]";
  }
  return "[" + (part && part.type) + "]";
}

function messageBox(message, extra) {
  const content = message.content;
  let text = "";
  if (typeof content === "string") text = content;
  else if (Array.isArray(content)) text = content.map(partText).join("\n");
  const calls = (message.tool_calls || []).map((c) => "→ " + (c.function || {}).name + "(" + (typeof (c.function || {}).arguments === "string" ? c.function.arguments : JSON.stringify((c.function || {}).arguments)) + ")");
  return el("div", { class: "message", dataset: { role: message.role || "assistant" } },
    el("div", { class: "role" }, (message.role || "assistant") + (extra ? " · " + extra : "") + (message.tool_call_id ? " · answers " + message.tool_call_id : "")),
    message.reasoning_content ? el("pre", { class: "reasoning" }, "[reasoning] " + message.reasoning_content) : null,
    text ? el("pre", {}, text) : null, calls.length ? el("pre", { class: "calls" }, calls.join("\n")) : null);
}

async function turnView(session, turn) {
  const data = await api("/api/turn", { session, turn });
  const t = data.tokens;
  setWhere("session " + t.session_id + " · turn " + t.turn_id);
  const facts = el("p", { class: "facts", id: "turn-facts" },
    "session " + t.session_id + " · turn " + t.turn_id + " · parent ", t.parent_turn_id === null ? "none (a root)" : turnLink(t.session_id, t.parent_turn_id, String(t.parent_turn_id)),
    " · episode ", episodeLink(t.episode), " · ", callPill(t.call),
    t.segment ? " · segment " + t.segment.index + " (from turn " + t.segment.first_turn + ")" : "",
    t.follows ? [" · follows ", turnLink(t.follows.session, t.follows.turn_id, "session " + t.follows.session + " turn " + t.follows.turn_id), " (" + t.follows.how + ")"] : "",
    " · " + t.api + " · " + (t.model || "–") + " (" + t.family + ") · weights " + (t.weight_version || "not reported") + " · finish " + (t.finish_reason || "–"));
  const idsToggle = el("label", {}, el("input", { type: "checkbox", id: "show-ids", onchange: (event) => {
    document.getElementById("tokens").classList.toggle("show-ids", event.target.checked);
  } }), " show ids");
  const tokens = el("div", { class: "tokens", id: "tokens" },
    el("span", { class: "run-head" }, "prompt: the " + t.prompt_added.ids.length + " tokens this turn added (positions " + t.prompt_added.start + "–" + (t.prompt_len - 1) + " of " + t.prompt_len + ")"),
    tokenRun(t.prompt_added, false, null, t.images),
    el("span", { class: "run-head" }, "completion: " + t.completion.ids.length + " sampled tokens, shaded by log-prob (the less likely, the darker)"),
    tokenRun(t.completion, true, t.weight_version));
  const appended = data.appended_messages ? data.appended_messages.map((m) => messageBox(m, "appended"))
    : [el("p", { class: "facts" }, data.appended_keys + " appended messages (recorded without their text)")];
  const notes = data.annotations.map((n) => el("pre", { class: "annotation" }, JSON.stringify(n, null, 1)));
  const audits = BUNDLE ? [] : data.leaves.map((leaf) => el("li", {}, link("/audit?session=" + enc(t.session_id) + "&leaf=" + leaf,
    "drift audit of the branch ending at turn " + leaf, { class: "audit-link", target: "_blank" })));
  show(
    el("h1", {}, "Turn " + t.turn_id + " of session " + t.session_id), facts,
    el("div", { class: "columns" },
      el("div", {}, idsToggle, tokens),
      el("div", { class: "messages" }, el("h2", {}, "Messages this turn appended"), appended,
        el("h2", {}, "What the model said"), messageBox(data.assistant_message, "sampled"),
        notes.length ? [el("h2", {}, "Annotations"), notes] : null,
        audits.length ? [el("h2", {}, "Drift audit"), el("ul", {}, audits)] : null,
        el("h2", {}, "Record"), el("pre", { id: "record" }, JSON.stringify(data.record, null, 1)))));
}

// -- a GRPO group --------------------------------------------------------------------------------------------------

async function groupView(group) {
  const data = await api("/api/group", { id: group });
  setWhere("group " + data.group);
  const maxLength = Math.max(1, ...data.episodes.map((e) => e.length));
  const rewards = data.episodes.map((e) => e.reward).filter((r) => r !== null);
  const top = Math.max(1e-9, ...rewards.map(Math.abs));
  const cards = data.episodes.map((e) => el("div", { class: "episode-card", dataset: { episode: e.episode } },
    el("div", {}, episodeLink(e.episode)),
    el("div", { class: "reward" }, "reward " + fmt(e.reward, 3), e.reward !== null ? el("span", { class: "bar reward", style: "width:" + Math.round(80 * Math.abs(e.reward) / top) + "px" }) : null),
    el("div", {}, "advantage " + fmt(e.advantage, 3)),
    el("div", { class: "length" }, "length " + e.length, el("span", { class: "bar", style: "width:" + Math.round(80 * e.length / maxLength) + "px" })),
    el("div", {}, e.turns + " turns · " + e.sampled_tokens + " sampled · ", Object.entries(e.calls).map(([c, n]) => callPill(c, c + " " + n))),
    el("div", {}, turnLink(e.last_turn.session, e.last_turn.turn_id, "last turn")),
    el("div", { class: "answer" }, e.answer)));
  show(el("h1", {}, "Group " + data.group),
    el("p", { class: "facts", id: "group-facts" }, data.episodes.length + " episodes · mean reward " + fmt(data.mean_reward, 3) + " · std " + fmt(data.reward_std, 3)),
    el("div", { class: "episodes-side", id: "group-episodes" }, cards));
}

// -- routing -------------------------------------------------------------------------------------------------------

async function route() {
  const hash = location.hash.replace(/^#/, "") || "/";
  const [path, query] = hash.split("?");
  const parts = path.split("/").slice(1).map(decodeURIComponent);
  document.body.dataset.ready = "";
  try {
    if (BUNDLE && (parts[0] === "" || parts[0] === "sessions")) await episodeView(BUNDLE.episode.episode);
    else if (parts[0] === "" ) await episodesView(new URLSearchParams(query || ""));
    else if (parts[0] === "sessions") await sessionsView();
    else if (parts[0] === "episode") await episodeView(parts[1]);
    else if (parts[0] === "turn") await turnView(parts[1], parts[2]);
    else if (parts[0] === "group") await groupView(parts[1]);
    else throw new Error("no such page: " + hash);
  } catch (error) {
    fail(error);
  }
  document.body.dataset.ready = location.hash || "#/";  // the page drawn for this address: what a test waits on
}

window.addEventListener("hashchange", route);
route();
