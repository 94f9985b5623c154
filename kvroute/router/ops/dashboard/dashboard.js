// kvroute dashboard: vanilla JS, no build step. Reads the router's admin API every second.
// Every value from the router is inserted as text (textContent), never as HTML.
"use strict";

(function () {
  const POLL_MS = 1000;
  const DECISIONS_SHOWN = 30;
  const TOKEN_KEY = "kvroute.adminToken";

  const $ = (id) => document.getElementById(id);
  const groupKinds = new Map(); // group id -> kind, learned from /admin/score answers
  const seenDecisions = new Set();
  let token = null;
  let timer = null;
  let firstDecisions = true;

  // ---------------------------------------------------------------- token
  function tokenFromFragment() {
    const hash = window.location.hash.replace(/^#/, "");
    const value = new URLSearchParams(hash).get("token");
    if (value) {
      // Keep the token out of the address bar, history and screenshots.
      history.replaceState(null, "", window.location.pathname + window.location.search);
    }
    return value;
  }

  function loadToken() {
    const fromUrl = tokenFromFragment();
    if (fromUrl) {
      sessionStorage.setItem(TOKEN_KEY, fromUrl);
      return fromUrl;
    }
    return sessionStorage.getItem(TOKEN_KEY);
  }

  function showLogin(message) {
    stopPolling();
    $("main").hidden = true;
    $("logout").hidden = true;
    $("login").hidden = false;
    $("login-error").textContent = message || "";
    setStatus("idle", "not connected");
    $("token-input").focus();
  }

  function showMain() {
    $("login").hidden = true;
    $("main").hidden = false;
    $("logout").hidden = false;
  }

  // ---------------------------------------------------------------- helpers
  class AuthError extends Error {}

  async function api(path, body) {
    const opts = { headers: { Authorization: "Bearer " + token }, cache: "no-store" };
    if (body !== undefined) {
      opts.method = "POST";
      opts.headers["Content-Type"] = "application/json";
      opts.body = JSON.stringify(body);
    }
    const resp = await fetch(path, opts);
    if (resp.status === 401 || resp.status === 403) {
      let msg = "the router refused the token";
      try { msg = (await resp.json()).error.message || msg; } catch (e) { /* keep default */ }
      throw new AuthError(msg);
    }
    const data = await resp.json();
    if (!resp.ok) {
      throw new Error((data && data.error && data.error.message) || "HTTP " + resp.status);
    }
    return data;
  }

  function el(tag, text, cls) {
    const node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = String(text);
    if (cls) node.className = cls;
    return node;
  }

  function td(text, cls) { return el("td", text, cls); }

  const nf = new Intl.NumberFormat("en-US");
  function num(x) { return x === null || x === undefined ? "–" : nf.format(x); }
  function secs(x) { return x === null || x === undefined ? "–" : x.toFixed(3) + " s"; }

  function bar(fraction, wide) {
    const outer = el("span", null, wide ? "bar wide" : "bar");
    const inner = el("span");
    inner.style.width = Math.max(0, Math.min(1, fraction || 0)) * 100 + "%";
    outer.appendChild(inner);
    return outer;
  }

  function badge(text, kind) { return el("span", text, "badge " + (kind || "")); }

  function setStatus(state, text) {
    const s = $("status");
    s.dataset.state = state;
    s.textContent = text;
  }

  function kindOf(groupId) { return groupKinds.get(String(groupId)) || "group " + groupId; }

  // ---------------------------------------------------------------- workers
  function healthBadge(w) {
    const status = w.status;
    const kind = status === "ready" ? "ok" : (status === "unknown" || status === "draining") ? "warn" : "bad";
    const b = badge(status, kind);
    if (w.health_error) b.title = w.health_error;
    return b;
  }

  function renderWorkers(data) {
    const body = $("workers").querySelector("tbody");
    body.replaceChildren();
    let ready = 0;
    for (const w of data.workers) {
      if (w.status === "ready") ready += 1;
      const tr = el("tr");
      tr.dataset.worker = w.name;

      const name = td();
      name.appendChild(el("div", w.name, "name"));
      if (w.role && w.role !== "both") name.appendChild(el("div", w.role + " worker", "role"));
      name.appendChild(el("div", w.url, "muted"));
      tr.appendChild(name);

      const health = td();
      health.appendChild(healthBadge(w));
      if (w.breaker && w.breaker.state !== "closed") {
        health.appendChild(el("div", "breaker " + w.breaker.state, "muted"));
      }
      tr.appendChild(health);

      const load = w.load || {};
      const eng = load.engine;
      const loadCell = td();
      loadCell.appendChild(el("div", num(load.running) + " in flight · " + num(load.requests_total) + " routed"));
      if (eng) {
        loadCell.appendChild(el("div", "engine: " + num(eng.running) + " running, " + num(eng.waiting) + " waiting", "muted"));
      }
      loadCell.appendChild(el("div", num(load.queued_prefill_tokens) + " prefill tokens queued", "muted"));
      if (load.step_period_s) {
        loadCell.appendChild(el("div", "step " + (load.step_period_s * 1000).toFixed(1) + " ms", "muted"));
      }
      if (load.cpu_tier_tokens_per_s !== null && load.cpu_tier_tokens_per_s !== undefined) {
        loadCell.appendChild(cpuTierLine(load));
      }
      tr.appendChild(loadCell);

      const kv = td();
      if (eng && eng.kv_usage !== null && eng.kv_usage !== undefined) {
        kv.appendChild(bar(eng.kv_usage));
        kv.appendChild(document.createTextNode((100 * eng.kv_usage).toFixed(1) + "%"));
      } else {
        kv.textContent = "–";
      }
      tr.appendChild(kv);
      tr.appendChild(poolCell(w));

      const groups = td(null, "groups");
      const idx = w.index;
      if (idx && idx.blocks_per_group) {
        for (const [gid, n] of Object.entries(idx.blocks_per_group)) {
          const span = el("span");
          span.appendChild(el("b", kindOf(gid) + ": "));
          span.appendChild(document.createTextNode(num(n)));
          groups.appendChild(span);
        }
        const empty = Object.keys(idx.blocks_per_group).length === 0;
        if (empty && idx.last_sequence === null) {
          groups.appendChild(el("span", "nothing reported yet", "muted"));
        } else {
          if (!idx.valid) groups.appendChild(badge("view invalid", "bad"));
          if (empty) groups.appendChild(el("span", "empty", "muted"));
        }
      } else {
        groups.textContent = "–";
      }
      tr.appendChild(groups);

      const ev = w.events;
      const evCell = td();
      if (ev) {
        evCell.appendChild(badge(ev.state, ev.state === "live" ? "ok" : "warn"));
        const lag = ev.lag_s === null ? "no event yet" : "last event " + ev.lag_s.toFixed(1) + " s ago";
        evCell.appendChild(el("div", lag + " · seq " + num(ev.last_sequence), "muted"));
        if (ev.last_error) evCell.appendChild(el("div", ev.last_error, "error"));
      } else {
        evCell.textContent = w.bridge || w.zmq ? "–" : "no event source";
      }
      tr.appendChild(evCell);

      const p = w.prediction;
      const pred = td();
      if (p && p.verified) {
        pred.appendChild(el("div", p.mean_abs_error_tokens.toFixed(1) + " tokens mean error"));
        pred.appendChild(el("div", num(p.verified - p.misses) + " / " + num(p.verified) + " exact" +
          (p.resyncs ? " · " + p.resyncs + " resyncs" : ""), "muted"));
      } else {
        pred.textContent = "no response checked yet";
        pred.className = "muted";
      }
      tr.appendChild(pred);
      body.appendChild(tr);
    }
    $("fleet-summary").textContent = ready + " of " + data.workers.length + " ready";
  }

  // The rate a worker's CPU-tier tokens are priced at, present when the router learns each
  // worker's (policy.learn_cpu_tier_rate): learned from its engine's loads, or the configured
  // one until then. The learned rate is bounded around the configured one; the title says
  // what was measured.
  function cpuTierLine(load) {
    const measured = load.cpu_tier_tokens_per_s_learned;
    const learned = measured !== null && measured !== undefined;
    const line = el("div", "CPU tier " + num(Math.round(load.cpu_tier_tokens_per_s)) + " tokens/s " +
      (learned ? "learned" : "configured"), "muted cpu-tier");
    line.dataset.tokensPerS = String(load.cpu_tier_tokens_per_s);
    line.dataset.learned = String(learned);
    line.title = learned
      ? "measured " + num(Math.round(measured)) + " tokens/s from the engine's CPU-tier loads"
      : "policy.cpu_tier_tokens_per_s, until the engine's CPU-tier loads teach a rate";
    return line;
  }

  // A worker's KV pool (what its engine reports, and the most blocks its events showed per
  // group) beside the working set: the conversations this router expects back on it.
  function poolCell(w) {
    const cell = td(null, "pool");
    const cap = w.capacity || {};
    const ws = w.working_set || {};
    const pool = el("div", null, "capacity");
    pool.dataset.tokens = cap.tokens === null || cap.tokens === undefined ? "" : String(cap.tokens);
    pool.textContent = cap.tokens ? "pool " + num(cap.tokens) + " tokens" : "pool not reported";
    cell.appendChild(pool);
    const peaks = Object.entries(cap.peak_blocks_per_group || {});
    if (peaks.length) {
      const text = peaks.map(([gid, n]) => kindOf(gid) + " " + num(n)).join(", ");
      cell.appendChild(el("div", "most blocks seen: " + text, "muted"));
    }
    const set = el("div", null, "working-set");
    set.dataset.conversations = String(ws.conversations || 0);
    set.dataset.tokens = String(ws.tokens || 0);
    set.textContent = "working set " + num(ws.conversations || 0) + " conversations, " +
      num(ws.tokens || 0) + " tokens";
    if (cap.tokens) {
      const fill = (ws.tokens || 0) / cap.tokens;
      cell.appendChild(bar(fill));
      set.textContent += " (" + (100 * fill).toFixed(0) + "% of the pool)";
      if (fill > 1) set.classList.add("error");
    }
    cell.appendChild(set);
    return cell;
  }

  // ---------------------------------------------------------------- decisions
  // The cost terms of one candidate that are not zero, in milliseconds (they sum to its
  // cost; the junction credit is negative).
  function termsText(c) {
    const parts = [];
    for (const [name, v] of Object.entries(c.terms || {})) {
      if (v) parts.push(name + " " + (v * 1000).toFixed(2));
    }
    return parts.length ? parts.join(" · ") + " ms" : "";
  }

  function termsTitle(c) {
    const lines = Object.entries(c.terms || {}).map(([name, v]) => name + ": " + (v * 1000).toFixed(3) + " ms");
    return lines.length ? "\ncost " + (c.cost_s * 1000).toFixed(3) + " ms = " + lines.join(", ") : "";
  }

  // What a candidate loads from its lower KV tiers beyond its GPU reuse ("" without any).
  function tierText(c) {
    const t = c.tier_tokens || {};
    const parts = [];
    if (t.cpu) parts.push(num(t.cpu) + " CPU");
    if (t.storage) parts.push(num(t.storage) + " storage");
    return parts.length ? " + " + parts.join(" + ") : "";
  }

  function scoreChips(d) {
    const wrap = el("div", null, "scores");
    const cands = (d.candidates || []).slice().sort((a, b) => a.worker.localeCompare(b.worker));
    for (const c of cands) {
      const chip = el("span", null, "score" + (c.worker === d.chosen ? " chosen" : ""));
      chip.appendChild(el("span", c.worker, "w"));
      chip.appendChild(document.createTextNode(
        (c.predicted_reuse === null ? "no evidence" : num(c.predicted_reuse) + " tok") +
        tierText(c) + " · " + c.est_ttft_s.toFixed(3) + " s" + (c.saturated ? " · saturated" : "")));
      chip.title = "uncached " + num(c.uncached_tokens) + " tokens, running " + num(c.running) +
        ", queued prefill " + num(c.queued_prefill_tokens) + " tokens" +
        termsTitle(c);
      const terms = termsText(c);
      if (terms) chip.appendChild(el("span", terms, "terms"));
      wrap.appendChild(chip);
    }
    return wrap;
  }

  // The chosen worker; for a disaggregated request, "prefill → decode" with every try.
  function chosenCell(d) {
    const cell = td(d.chosen || "–");
    const pd = d.pd;
    if (!pd || !pd.decode.length) return cell;
    cell.classList.add("pd");
    cell.textContent = (d.chosen || "–") + " → " + pd.decode[pd.decode.length - 1].worker;
    const tries = (list) => list.map((a) => a.worker + " " + a.outcome).join(", ");
    cell.title = "prefill: " + tries(pd.prefill) + "; decode: " + tries(pd.decode);
    return cell;
  }

  function renderDecisions(data) {
    const body = $("decisions").querySelector("tbody");
    const rows = data.decisions.slice().reverse(); // newest first
    body.replaceChildren();
    for (const d of rows) {
      const tr = el("tr");
      tr.dataset.decision = d.id;
      tr.dataset.request = d.request_id;
      if (!seenDecisions.has(d.id)) {
        seenDecisions.add(d.id);
        if (!firstDecisions) tr.className = "fresh";
      }
      tr.appendChild(td(new Date(d.time * 1000).toLocaleTimeString()));
      tr.appendChild(td(d.request_id));
      const prompt = td(num(d.prompt_tokens), "num");
      if (d.upstream_endpoint && d.upstream_endpoint !== d.endpoint) {
        prompt.appendChild(el("span", " ids", "as-ids"));
        prompt.title = "sent to the engine as " + d.upstream_endpoint +
          " of the router's token ids (send_token_ids): the engine did not tokenize it again";
      }
      tr.appendChild(prompt);
      tr.appendChild(chosenCell(d));
      const reason = td(d.reason);
      reason.title = d.detail || "";
      tr.appendChild(reason);
      tr.appendChild(td(num(d.predicted_cached_tokens), "num"));
      const engine = td(d.reported_cached_tokens === null ? "…" : num(d.reported_cached_tokens), "num");
      if (d.reported_cached_tokens === null) engine.title = "not reported (yet)";
      if (d.outcome) {
        engine.classList.add("outcome-" + d.outcome);
        engine.title = "prediction " + d.outcome;
      }
      tr.appendChild(engine);
      const chips = td();
      chips.appendChild(scoreChips(d));
      tr.appendChild(chips);
      body.appendChild(tr);
    }
    firstDecisions = false;
    if (seenDecisions.size > 5000) seenDecisions.clear();
    const last = data.decisions[data.decisions.length - 1];
    $("decisions-summary").textContent = last ? "(" + num(last.id) + " routed since start, policy " + last.policy + ")" : "(none yet)";
  }

  // ---------------------------------------------------------------- polling
  async function poll() {
    try {
      const [workers, decisions] = await Promise.all([
        api("/admin/workers"),
        api("/admin/decisions?limit=" + DECISIONS_SHOWN),
      ]);
      renderWorkers(workers);
      renderDecisions(decisions);
      setStatus("live", "live · updated " + new Date().toLocaleTimeString());
    } catch (err) {
      if (err instanceof AuthError) {
        sessionStorage.removeItem(TOKEN_KEY);
        showLogin(err.message);
        return;
      }
      setStatus("error", "router unreachable: " + err.message);
    }
    timer = setTimeout(poll, POLL_MS);
  }

  function startPolling() {
    stopPolling();
    showMain();
    poll();
  }

  function stopPolling() {
    if (timer !== null) clearTimeout(timer);
    timer = null;
  }

  // ---------------------------------------------------------------- scoring
  async function loadModels() {
    const select = $("score-model");
    try {
      const resp = await fetch("/v1/models", { cache: "no-store" });
      const data = await resp.json();
      select.replaceChildren();
      for (const m of data.data || []) select.appendChild(el("option", m.id));
    } catch (err) { /* the router answers without a model too when it serves one */ }
  }

  function scoreBody() {
    const text = $("score-input").value;
    const model = $("score-model").value || undefined;
    let body = null;
    const trimmed = text.trim();
    if (trimmed.startsWith("[") || trimmed.startsWith("{")) {
      try {
        const parsed = JSON.parse(trimmed);
        if (Array.isArray(parsed)) body = { messages: parsed };
        else if (parsed && (parsed.messages || parsed.prompt !== undefined || parsed.input)) body = parsed;
      } catch (e) { body = null; } // not JSON: score it as text
    }
    if (body === null) {
      body = $("score-as").value === "completion"
        ? { prompt: text }
        : { messages: [{ role: "user", content: text }] };
    }
    if (model && !body.model) body.model = model;
    const salt = $("score-salt").value.trim();
    if (salt && !body.cache_salt) body.cache_salt = salt;
    return body;
  }

  function learnKinds(result) {
    for (const w of result.workers || []) {
      for (const g of w.groups || []) groupKinds.set(String(g.group_id), g.kind);
    }
  }

  function renderScore(result) {
    learnKinds(result);
    $("score-result").hidden = false;
    $("score-summary").textContent =
      num(result.prompt_tokens) + " prompt tokens (ids: " + result.token_source + ") · policy " +
      result.policy + " would choose " + (result.chosen || "nobody") + " — " + result.reason +
      (result.detail ? ": " + result.detail : "");
    const body = $("score-table").querySelector("tbody");
    body.replaceChildren();
    const total = result.prompt_tokens || 1;
    for (const w of result.workers) {
      const tr = el("tr", null, w.chosen ? "chosen" : "");
      tr.dataset.worker = w.worker;
      tr.appendChild(td(w.worker));
      const reuse = td();
      reuse.appendChild(bar((w.predicted_reuse || 0) / total, true));
      reuse.appendChild(document.createTextNode(
        (w.predicted_reuse === null || w.predicted_reuse === undefined ? "no evidence" : num(w.predicted_reuse) + " tokens") +
        tierText(w)));
      reuse.dataset.reuse = w.predicted_reuse === null || w.predicted_reuse === undefined ? "" : String(w.predicted_reuse);
      const tiers = w.tier_tokens || {};
      reuse.dataset.cpu = String(tiers.cpu || 0);
      reuse.dataset.storage = String(tiers.storage || 0);
      reuse.className = "reuse";
      tr.appendChild(reuse);
      const groups = td(null, "groups");
      for (const g of w.groups || []) {
        const span = el("span");
        span.appendChild(el("b", g.kind + (g.sliding_window ? " " + g.sliding_window : "") + ": "));
        span.appendChild(document.createTextNode(g.accepted_tokens === null ? "–" : num(g.accepted_tokens)));
        groups.appendChild(span);
      }
      if (!(w.groups || []).length) groups.textContent = w.index_reason || "–";
      tr.appendChild(groups);
      const fa = w.full_attention_only_reuse;
      tr.appendChild(td(fa === null || fa === undefined ? "–" : num(fa) + " tokens" +
        (fa > (w.predicted_reuse || 0) ? " (overstates)" : "")));
      tr.appendChild(td(num(w.uncached_tokens), "num"));
      tr.appendChild(td(num(w.running), "num"));
      const est = td(w.est_ttft_s === undefined ? "–" : secs(w.est_ttft_s), "num");
      if (w.terms) {
        est.appendChild(el("span", termsText(w), "terms"));
        est.title = termsTitle(w).trim();
      }
      tr.appendChild(est);
      tr.appendChild(td(w.chosen ? "← chosen" : (w.eligible ? "" : "not eligible")));
      body.appendChild(tr);
    }
  }

  async function score(ev) {
    ev.preventDefault();
    $("score-error").textContent = "";
    try {
      renderScore(await api("/admin/score", scoreBody()));
    } catch (err) {
      if (err instanceof AuthError) { showLogin(err.message); return; }
      $("score-error").textContent = err.message;
    }
  }

  async function learnGroupKinds() {
    // A side-effect-free score names each worker's KV cache groups (kind, window).
    try {
      const model = $("score-model").value || undefined;
      learnKinds(await api("/admin/score", { model: model, messages: [{ role: "user", content: "hi" }] }));
    } catch (err) { /* labels fall back to group ids */ }
  }

  // ---------------------------------------------------------------- start
  $("login-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const value = $("token-input").value.trim();
    if (!value) return;
    token = value;
    sessionStorage.setItem(TOKEN_KEY, token);
    $("token-input").value = "";
    startPolling();
    learnGroupKinds();
  });
  $("logout").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    token = null;
    showLogin("");
  });
  $("score-form").addEventListener("submit", score);

  token = loadToken();
  loadModels().then(() => {
    if (token) learnGroupKinds();
  });
  if (token) startPolling();
  else showLogin("");
})();
