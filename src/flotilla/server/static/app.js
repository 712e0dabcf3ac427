// flotilla's dashboard: plain JavaScript, no build step, no library. It reads the JSON API
// (/api/v1/...) with the cookie the server set, and follows Server-Sent Events: the
// clusters' states (/api/v1/events), a cluster's events and views, a job's output.
"use strict";

const PAGE = 50;            // node rows per page: a 128-node cluster is 3 pages
const HISTORY = 300;        // samples kept per node for the charts (about 5 minutes)
const $ = (sel, root) => (root || document).querySelector(sel);
const main = $("#main");
let streams = [];           // the EventSources of the page shown
let timer = null;
let shown = 0;              // the page's number: a late answer for an earlier page is dropped

// An element's handlers live in el.on (one listener per event type reads it), so that
// patch() can hand a redrawn element's handlers to the element already on the page.
function handle(e) {
  const fn = (e.currentTarget.on || {})[e.type];
  if (fn) fn(e);
}

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k.startsWith("on")) {
      if (!el.on) el.on = {};
      el.on[k.slice(2)] = v;
      el.addEventListener(k.slice(2), handle);
    } else if (v !== null && v !== undefined && v !== false) el.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) {
    if (c !== null && c !== undefined) el.append(c instanceof Node ? c : String(c));
  }
  return el;
}

// Make `old` look like `fresh` while keeping the elements that are already on the page:
// a redraw every few seconds must not swap a link or button out from under a click (a
// press and a release on two different elements is no click) or lose the focus.
function morph(old, fresh) {
  if (old.nodeType !== fresh.nodeType || old.nodeName !== fresh.nodeName ||
      old.namespaceURI !== fresh.namespaceURI) {
    old.replaceWith(fresh);
    return;
  }
  if (old.nodeType !== Node.ELEMENT_NODE) {
    if (old.nodeValue !== fresh.nodeValue) old.nodeValue = fresh.nodeValue;
    return;
  }
  for (const a of [...old.attributes]) if (!fresh.hasAttribute(a.name)) old.removeAttribute(a.name);
  for (const a of fresh.attributes) {
    if (old.getAttribute(a.name) !== a.value) old.setAttribute(a.name, a.value);
  }
  if (fresh.on) {
    for (const type of Object.keys(fresh.on)) {
      if (!old.on || !(type in old.on)) old.addEventListener(type, handle);
    }
  }
  old.on = fresh.on;
  patch(old, ...fresh.childNodes);
}

// replaceChildren that keeps what is already there (see morph)
function patch(parent, ...children) {
  const fresh = children.flat().filter((c) => c !== null && c !== undefined)
    .map((c) => (c instanceof Node ? c : document.createTextNode(String(c))));
  const now = [...parent.childNodes];
  fresh.forEach((c, i) => (i < now.length ? morph(now[i], c) : parent.append(c)));
  for (const extra of now.slice(fresh.length)) extra.remove();
}

async function call(method, path, body) {
  const init = { method, credentials: "same-origin", headers: {} };
  if (body !== undefined) {
    init.body = JSON.stringify(body);
    init.headers["Content-Type"] = "application/json";
  }
  const r = await fetch(path, init);
  const data = await r.json().catch(() => ({}));
  if (!r.ok) throw new Error(data.error || `${method} ${path}: ${r.status}`);
  return data;
}

function follow(path, handlers) {
  const es = new EventSource(path);
  for (const [name, fn] of Object.entries(handlers)) {
    es.addEventListener(name, (e) => fn(JSON.parse(e.data)));
  }
  es.onopen = () => $("#live").classList.add("on");
  es.onerror = () => $("#live").classList.remove("on");
  streams.push(es);
  return es;
}

function leave() {
  streams.forEach((s) => s.close());
  streams = [];
  if (timer) clearInterval(timer);
  timer = null;
}

const ago = (t) => {
  if (!t) return "-";
  const s = Math.max(0, Date.now() / 1000 - t);
  if (s < 60) return `${s.toFixed(0)}s`;
  if (s < 3600) return `${(s / 60).toFixed(0)}m`;
  return `${(s / 3600).toFixed(1)}h`;
};
const size = (n) => {
  for (const [u, k] of [["T", 2 ** 40], ["G", 2 ** 30], ["M", 2 ** 20]]) {
    if (n >= k) return `${(n / k).toFixed(1)}${u}`;
  }
  return `${(n / 1024).toFixed(0)}K`;
};
const state = (s) => h("span", { class: `state state-${s}` }, s);

// -- the overview: clusters, managed jobs, pools ------------------------------------------
async function overview() {
  $("#crumbs").replaceChildren();
  const mine = shown;
  const draw = async () => {
    let clusters, managed, pools;
    try {
      [clusters, managed, pools] = await Promise.all([
        call("GET", "/api/v1/clusters"), call("GET", "/api/v1/managed-jobs"),
        call("GET", "/api/v1/pools")]);
    } catch (e) {
      if (mine === shown) main.replaceChildren(h("p", { class: "error" }, e.message));
      return;
    }
    if (mine !== shown) return;
    const rows = clusters.clusters.map((c) => h("tr", { "data-cluster": c.name },
      h("td", {}, h("a", { href: `#/cluster/${encodeURIComponent(c.name)}` }, c.name)),
      h("td", {}, state(c.state)), h("td", {}, c.provider || "-"),
      h("td", { class: "num" }, c.num_nodes ?? "-"), h("td", { class: "num" }, c.jobs_running ?? "-"),
      h("td", { class: "num" }, ago(c.created)), h("td", { class: "muted" }, c.error || "")));
    const jobs = managed.jobs.map((j) => h("tr", {},
      h("td", { class: "num" }, j.id), h("td", {}, j.name), h("td", {}, state(j.state)),
      h("td", { class: "num" }, j.num_nodes), h("td", { class: "num" }, j.recoveries),
      h("td", { class: "num" }, ago(j.submitted)),
      h("td", {}, ["SUCCEEDED", "FAILED", "CANCELLED"].includes(j.state) ? "" :
        h("button", { class: "danger", onclick: () => act(`cancel managed job ${j.id}?`,
          "POST", `/api/v1/managed-jobs/${j.id}/cancel`) }, "cancel"))));
    const pooled = pools.pools.map((p) => h("tr", {},
      h("td", {}, p.pool || "-"), h("td", { class: "num" }, p.pid), h("td", {}, p.phase || "-"),
      h("td", { class: "num" }, (p.nodes || []).length), h("td", { class: "muted" }, p.program || "")));
    patch(main,
      h("section", {}, h("h2", {}, "Clusters"), rows.length ? h("table", { id: "clusters" },
        h("thead", {}, h("tr", {}, ["name", "state", "provider", "nodes", "jobs running", "age", ""]
          .map((t) => h("th", {}, t)))), h("tbody", {}, rows))
        : h("p", { class: "muted" }, "no clusters (flotilla launch TASK -c NAME starts one)")),
      h("section", {}, h("h2", {}, "Managed jobs"), jobs.length ? h("table", { id: "managed" },
        h("thead", {}, h("tr", {}, ["id", "name", "state", "nodes", "recoveries", "age", ""]
          .map((t) => h("th", {}, t)))), h("tbody", {}, jobs))
        : h("p", { class: "muted" }, "no managed jobs")),
      h("section", {}, h("h2", {}, "Python pools"), pooled.length ? h("table", { id: "pools" },
        h("thead", {}, h("tr", {}, ["pool", "pid", "phase", "nodes", "program"]
          .map((t) => h("th", {}, t)))), h("tbody", {}, pooled))
        : h("p", { class: "muted" }, "no Python pool runs")));
  };
  await draw();
  let pending = null;
  follow("/api/v1/events", {
    state: () => { clearTimeout(pending); pending = setTimeout(draw, 300); },
  });
  timer = setInterval(draw, 10000);
}

async function act(question, method, path, body) {
  if (!window.confirm(question)) return null;
  try {
    return await call(method, path, body);
  } catch (e) {
    window.alert(e.message);
    return null;
  }
}

// -- one cluster --------------------------------------------------------------------------
function spark(points, max) {
  const w = 90, hgt = 18;
  if (points.length < 2) return h("svg", { class: "spark", width: w, height: hgt });
  const top = max || Math.max(...points, 5);   // no max: scaled to what was seen
  const step = w / (Math.min(HISTORY, Math.max(points.length, 60)) - 1);
  const x0 = w - step * (points.length - 1);
  const coords = points.map((v, i) =>
    `${(x0 + i * step).toFixed(1)},${(hgt - 1 - (v / top) * (hgt - 2)).toFixed(1)}`).join(" ");
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("class", "spark");
  svg.setAttribute("width", w);
  svg.setAttribute("height", hgt);
  const line = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
  line.setAttribute("points", coords);
  svg.append(line);
  return svg;
}

function describe(e) {
  const t = new Date((e.time || 0) * 1000).toLocaleTimeString();
  const node = `node ${e.node}`;
  switch (e.type) {
    case "PoolPhase": return `${t} pool ${e.phase}`;
    case "NodeReady": return `${t} ${node} ready ${e.host || e.address || ""}`;
    case "NodeLost": return `${t} ${node} lost: ${e.why}`;
    case "NodeReplaced": return `${t} ${node} replaced`;
    case "NodeHealthFailed": return `${t} ${node} failed its health check: ${e.why}`;
    case "JobState": return `${t} job ${e.job} ${String(e.state).toLowerCase()} ${e.detail || ""}`;
    case "Scaling": return `${t} pool now has ${e.nodes} node(s)`;
    case "TaskStarted": return `${t} ${node} started ${e.function} (task ${e.task})`;
    case "TaskFinished":
      return `${t} ${node} finished ${e.function} in ${Number(e.duration).toFixed(2)} s` +
        (e.ok ? "" : `: ${e.error}`);
    case "MetricFailed": return `${t} ${node} metric ${e.name} off: ${e.why}`;
    default: return `${t} ${e.type}`;
  }
}

async function clusterPage(name) {
  const crumbs = $("#crumbs");
  crumbs.replaceChildren(h("a", { href: "#/" }, "clusters"), " / ", h("span", {}, name));
  const history = new Map();   // node -> {cpu: [], mem: []}
  let view = null, page = 0, shownJob = null, output = null;
  const nodesBody = h("tbody", {});
  const jobsBody = h("tbody", {});
  const pager = h("div", { class: "pager" });
  const head = h("div", { class: "bar" });
  const events = h("ol", { id: "events" });
  const out = h("pre", { id: "output" });
  const outTitle = h("h2", {}, "Output");
  main.replaceChildren(
    h("section", {}, head),
    h("section", {}, h("h2", {}, "Nodes"), pager, h("table", { id: "nodes" }, h("thead", {}, h("tr", {},
      ["node", "phase", "address", "cpu", "memory", "gpu", "calls"].map((t) => h("th", {}, t)))),
    nodesBody)),
    h("section", {}, h("h2", {}, "Jobs"), h("table", { id: "jobs" }, h("thead", {}, h("tr", {},
      ["id", "name", "status", "nodes", "duration", "exit", ""].map((t) => h("th", {}, t)))),
    jobsBody)),
    h("section", {}, outTitle, out),
    h("section", {}, h("h2", {}, "Events"), events));

  const record = (v) => {
    for (const n of v.nodes || []) {
      const m = n.metrics || {};
      if (!history.has(n.node)) history.set(n.node, { cpu: [], mem: [], gpu: [], t: 0 });
      const hist = history.get(n.node);
      if (n.sampled && n.sampled === hist.t) continue;
      hist.t = n.sampled;
      if (m.cpu !== undefined) hist.cpu.push(m.cpu);
      if (m.mem_total) hist.mem.push(100 * m.mem_used / m.mem_total);
      const gpus = Object.keys(m).filter((k) => k.startsWith("gpu_util_")).map((k) => m[k]);
      if (gpus.length) hist.gpu.push(Math.max(...gpus));
      for (const k of ["cpu", "mem", "gpu"]) if (hist[k].length > HISTORY) hist[k].shift();
    }
  };

  const drawNodes = () => {
    const nodes = (view && view.nodes) || [];
    const pages = Math.max(1, Math.ceil(nodes.length / PAGE));
    page = Math.min(page, pages - 1);
    patch(nodesBody, ...nodes.slice(page * PAGE, (page + 1) * PAGE).map((n) => {
      const m = n.metrics || {};
      const hist = history.get(n.node) || { cpu: [], mem: [], gpu: [] };
      const gpus = Object.keys(m).filter((k) => k.startsWith("gpu_util_")).sort()
        .map((k) => `${m[k].toFixed(0)}%`).join(" ") || "-";
      return h("tr", { "data-node": n.node },
        h("td", { class: "num" }, n.node), h("td", { class: `phase-${n.phase}` }, n.phase),
        h("td", { class: "address" }, [n.address || n.ip, n.host].filter(Boolean).join(" · ") || "-"),
        h("td", { class: "cpu num" }, m.cpu !== undefined ? `${m.cpu.toFixed(1)}%` : "-",
          spark(hist.cpu)),
        h("td", { class: "mem num" }, m.mem_total ? `${size(m.mem_used)}/${size(m.mem_total)}` : "-",
          spark(hist.mem, 100)),
        h("td", { class: "gpu" }, gpus, hist.gpu.length ? spark(hist.gpu, 100) : null), h("td", { class: "num" }, `${n.running}/${n.done}`));
    }));
    patch(pager,
      h("button", { onclick: () => { page--; drawNodes(); }, disabled: page === 0 }, "previous"),
      h("span", { class: "muted", id: "page" }, `page ${page + 1} of ${pages} (${nodes.length} nodes)`),
      h("button", { onclick: () => { page++; drawNodes(); }, disabled: page >= pages - 1 }, "next"));
  };

  const drawHead = () => {
    if (!view) return;
    patch(head, ...[h("h2", {}, name), h("span", { id: "state" }, state(view.state)),
      h("span", { class: "muted" }, `${view.provider.kind || "?"} · ${view.num_nodes} node(s) · pool ${view.phase}`),
      view.error ? h("span", { class: "error" }, view.error) : null,
      h("span", { style: "margin-left:auto" }),
      h("button", { id: "down", class: "danger", onclick: async () => {
        if (await act(`tear down cluster ${name}? Its nodes, jobs and logs go.`, "DELETE",
          `/api/v1/clusters/${encodeURIComponent(name)}`)) location.hash = "#/";
      } }, "down")].filter((el) => el !== null));
  };

  const drawJobs = () => {
    const jobs = ((view && view.jobs) || []).slice().reverse();
    patch(jobsBody, ...jobs.map((j) => {
      const end = j.ended || Date.now() / 1000;
      const done = !["PENDING", "SETTING_UP", "RUNNING"].includes(j.status);
      return h("tr", { "data-job": j.id },
        h("td", { class: "num" }, j.id), h("td", {}, j.name), h("td", {}, state(j.status)),
        h("td", { class: "num" }, j.num_nodes), h("td", { class: "num" },
          j.started ? `${(end - j.started).toFixed(0)}s` : "-"),
        h("td", { class: "num" }, j.exit_code ?? ""),
        h("td", {}, h("button", { class: "show", onclick: () => showJob(j.id) }, "output"), " ",
          done ? null : h("button", { class: "danger cancel", onclick: () => act(
            `cancel job ${j.id} on ${name}?`, "POST",
            `/api/v1/clusters/${encodeURIComponent(name)}/jobs/${j.id}/cancel`) }, "cancel")));
    }));
  };

  const showJob = (id) => {
    if (output) output.close();
    shownJob = id;
    out.textContent = "";
    outTitle.textContent = `Output of job ${id}`;
    output = follow(`/api/v1/clusters/${encodeURIComponent(name)}/jobs/${id}/output`, {
      output: (d) => {
        const stick = out.scrollTop + out.clientHeight >= out.scrollHeight - 4;
        out.append(d.lines.join("\n") + "\n");
        if (stick) out.scrollTop = out.scrollHeight;
      },
      end: (d) => {
        out.append(`-- job ${id} ended: ${d.status}${d.exit_code != null ? ` (exit ${d.exit_code})` : ""}\n`);
        output.close();
      },
    });
  };

  const mine = shown;
  const apply = (v) => {
    if (mine !== shown) return;
    view = v;
    record(v);
    drawHead();
    drawNodes();
    drawJobs();
    if (shownJob === null && v.jobs && v.jobs.length) showJob(v.jobs[v.jobs.length - 1].id);
  };
  try {
    apply(await call("GET", `/api/v1/clusters/${encodeURIComponent(name)}`));
  } catch (e) {
    if (mine === shown) main.replaceChildren(h("p", { class: "error" }, e.message));
    return;
  }
  if (mine !== shown) return;
  follow(`/api/v1/clusters/${encodeURIComponent(name)}/events`, {
    view: apply,
    event: (e) => {
      events.prepend(h("li", {}, describe(e)));
      while (events.children.length > 500) events.lastChild.remove();
      if (e.type === "JobState") {
        call("GET", `/api/v1/clusters/${encodeURIComponent(name)}`).then(apply).catch(() => {});
      }
    },
    state: (s) => {
      if (s.state === "GONE") {
        main.replaceChildren(h("p", { class: "muted" }, `cluster ${name} is gone`));
        leave();
      } else if (view && view.state !== s.state) {
        call("GET", `/api/v1/clusters/${encodeURIComponent(name)}`).then(apply).catch(() => {});
      }
    },
  });
}

function route() {
  leave();
  shown += 1;
  const m = location.hash.match(/^#\/cluster\/(.+)$/);
  if (m) clusterPage(decodeURIComponent(m[1]));
  else overview();
}

window.addEventListener("hashchange", route);
route();
