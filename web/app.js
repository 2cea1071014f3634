/* restps monitoring page. Plain JavaScript, no libraries, nothing fetched from
 * outside this psd. Data:
 *   GET /v1/status             first paint, and every 2 s while polling
 *   GET /v1/events             Server-Sent Events; each event's data is the status JSON
 *   GET /v1/history?since=S    loss points [[step, loss, unix_secs]] and eval points
 *                              [[step, loss, accuracy, unix_secs]] after step S
 * Bounds: at most MAX_POINTS loss points kept here (older ones thinned to even
 * spacing in steps), one history request in flight and at most ~2 per second,
 * at most ~10 chart redraws per second. Any missing field shows as "—". */
(function () {
  "use strict";

  var DASH = "\u2014";
  var MAX_POINTS = 10000;       /* loss points kept in the page */
  var KEEP_RECENT = 2000;       /* newest points never thinned */
  var OLD_BUCKETS = 2000;       /* thinning keeps min and max loss of each bucket */
  var MAX_EVALS = 2000;
  var EMA_WEIGHT = 0.95;        /* smoothing per point, debiased as TensorBoard does */
  var HISTORY_GAP_MS = 500;     /* history requests at most ~2 per second */
  var DRAW_GAP_MS = 100;        /* redraws at most ~10 per second */
  var POLL_MS = 2000;           /* /v1/status polling when events fail */
  var SSE_MAX_ERRORS = 3;       /* errors in a row before giving events up for a while */
  var SSE_RETRY_MS = 30000;     /* while polling, try events again this often */
  var HISTORY_RETRY_MS = 30000; /* when /v1/history is not available */

  function $(id) { return document.getElementById(id); }
  function isNum(x) { return typeof x === "number" && isFinite(x); }
  function now() { return Date.now(); }

  /* ------------------------------------------------------------ formatting */

  function fmtInt(n) {
    if (!isNum(n)) return DASH;
    var s = String(Math.round(Math.abs(n))).replace(/\B(?=(\d{3})+(?!\d))/g, ",");
    return n < 0 ? "-" + s : s;
  }

  /* 0.52, 12.3, 318, 1.2k, 45k, 3.4M */
  function fmtSI(n) {
    if (!isNum(n)) return DASH;
    var a = Math.abs(n);
    if (a < 1000) {
      if (a === Math.round(a)) return String(n);
      return a < 10 ? n.toFixed(2) : a < 100 ? n.toFixed(1) : n.toFixed(0);
    }
    var units = ["k", "M", "G", "T", "P"];
    var v = n, i = -1;
    while (Math.abs(v) >= 999.5 && i < units.length - 1) { v /= 1000; i++; }
    var t = Math.abs(v) < 9.95 ? v.toFixed(1) : v.toFixed(0);
    return t.replace(/\.0$/, "") + units[i];
  }

  /* 512 B, 318 KB, 3.4 MB (powers of 1024) */
  function fmtBytes(n) {
    if (!isNum(n)) return DASH;
    if (n < 1024) return Math.round(n) + " B";
    var units = ["KB", "MB", "GB", "TB", "PB"];
    var v = n, i = -1;
    while (v >= 1023.95 && i < units.length - 1) { v /= 1024; i++; }
    return (v < 9.95 ? v.toFixed(1) : v.toFixed(0)).replace(/\.0$/, "") + " " + units[i];
  }

  function fmtLoss(x) {
    if (!isNum(x)) return DASH;
    var a = Math.abs(x);
    if (a !== 0 && (a < 1e-3 || a >= 1e5)) return x.toExponential(2);
    return a >= 1000 ? x.toFixed(0) : x.toPrecision(4);
  }

  function fmtNum(x) { return isNum(x) ? String(Number(x.toPrecision(4))) : DASH; }

  function fmtPct(x) { return isNum(x) ? (x * 100).toFixed(1) + " %" : DASH; }

  function fmtAge(secs) {
    if (!isNum(secs)) return DASH;
    if (secs < 0) secs = 0;
    if (secs < 1) return "now";
    if (secs < 60) return Math.floor(secs) + " s ago";
    if (secs < 3600) return Math.floor(secs / 60) + " min ago";
    if (secs < 86400) return Math.floor(secs / 3600) + " h ago";
    return Math.floor(secs / 86400) + " d ago";
  }

  function fmtDuration(secs) {
    if (!isNum(secs)) return DASH;
    secs = Math.max(0, Math.floor(secs));
    if (secs < 60) return secs + " s";
    if (secs < 3600) return Math.floor(secs / 60) + " min " + (secs % 60) + " s";
    if (secs < 86400) return Math.floor(secs / 3600) + " h " + Math.floor(secs % 3600 / 60) + " min";
    return Math.floor(secs / 86400) + " d " + Math.floor(secs % 86400 / 3600) + " h";
  }

  /* table cells: exact up to 9,999,999, then 12.3M (exact in the tooltip) */
  function fmtCount(n) { return isNum(n) && Math.abs(n) >= 1e7 ? fmtSI(n) : fmtInt(n); }

  function setText(id, text, title) {
    var el = $(id);
    if (!el) return;
    if (el.textContent !== text) el.textContent = text;
    if (title !== undefined) el.title = title;
  }

  /* ------------------------------------------------------------ the data */

  /* loss points, in increasing step order, as parallel arrays */
  var P = { step: [], loss: [], time: [], ema: [] };
  var emaRaw = 0, emaN = 0;
  /* eval points, in increasing step order */
  var E = { step: [], loss: [], acc: [], time: [] };

  var hist = {
    available: null,   /* null: unknown, true, false: fall back to points from status */
    inflight: false,
    timer: null,
    last: 0,           /* when the last request started */
    since: 0,          /* largest step received */
    globalStep: null,  /* global_step of the last answer */
    retryAt: 0,
    count: 0           /* answers received */
  };

  function resetData() {
    P = { step: [], loss: [], time: [], ema: [] };
    E = { step: [], loss: [], acc: [], time: [] };
    emaRaw = 0; emaN = 0;
    hist.since = 0; hist.globalStep = null;
  }

  function appendPoint(step, loss, t) {
    var n = P.step.length;
    if (n && step <= P.step[n - 1]) return false;
    emaRaw = EMA_WEIGHT * emaRaw + (1 - EMA_WEIGHT) * loss;
    emaN++;
    P.step.push(step);
    P.loss.push(loss);
    P.time.push(isNum(t) ? t : now() / 1000);
    P.ema.push(emaRaw / (1 - Math.pow(EMA_WEIGHT, emaN)));
    if (P.step.length > MAX_POINTS) thin();
    return true;
  }

  /* Keep the newest KEEP_RECENT points as they are; spread the older ones over
   * OLD_BUCKETS equal step ranges and keep the lowest and highest loss of each
   * (so the noise band survives), in step order. */
  function thin() {
    var n = P.step.length, cut = n - KEEP_RECENT;
    var s0 = P.step[0], s1 = P.step[cut], width = Math.max(1, (s1 - s0) / OLD_BUCKETS);
    var keep = [], b = -1, lo = -1, hi = -1, i;
    function flush() {
      if (lo < 0) return;
      if (lo === hi) keep.push(lo);
      else if (lo < hi) { keep.push(lo); keep.push(hi); }
      else { keep.push(hi); keep.push(lo); }
    }
    for (i = 0; i < cut; i++) {
      var bi = Math.floor((P.step[i] - s0) / width);
      if (bi !== b) { flush(); b = bi; lo = hi = i; continue; }
      if (P.loss[i] < P.loss[lo]) lo = i;
      if (P.loss[i] > P.loss[hi]) hi = i;
    }
    flush();
    for (i = cut; i < n; i++) keep.push(i);
    var Q = { step: new Array(keep.length), loss: new Array(keep.length),
              time: new Array(keep.length), ema: new Array(keep.length) };
    for (i = 0; i < keep.length; i++) {
      var k = keep[i];
      Q.step[i] = P.step[k]; Q.loss[i] = P.loss[k]; Q.time[i] = P.time[k]; Q.ema[i] = P.ema[k];
    }
    P = Q;
  }

  /* returns true when the point is new or changed */
  function putEval(step, loss, acc, t) {
    if (!isNum(step) || (!isNum(loss) && !isNum(acc))) return false;
    var n = E.step.length, i = n;
    while (i > 0 && E.step[i - 1] > step) i--;
    if (i > 0 && E.step[i - 1] === step) {
      i--;
      if (E.loss[i] === loss && E.acc[i] === acc) return false;
      E.loss[i] = loss; E.acc[i] = acc; E.time[i] = t;
      return true;
    }
    E.step.splice(i, 0, step); E.loss.splice(i, 0, loss);
    E.acc.splice(i, 0, acc); E.time.splice(i, 0, t);
    if (E.step.length > MAX_EVALS) {
      var len = E.step.length;
      var odd = function (_, j) { return j % 2 === 0 || j >= len - 200; };
      E = { step: E.step.filter(odd), loss: E.loss.filter(odd), acc: E.acc.filter(odd),
            time: E.time.filter(odd) };
    }
    return true;
  }

  function publishCounts() {
    var c = $("chart");
    c.setAttribute("data-points", String(P.step.length));
    c.setAttribute("data-evals", String(E.step.length));
    c.setAttribute("data-last-step", P.step.length ? String(P.step[P.step.length - 1]) : "");
    c.setAttribute("data-source", hist.available === false ? "status" : "history");
  }

  /* ------------------------------------------------------------ /v1/history */

  function scheduleHistory() {
    if (hist.timer || hist.inflight) { hist.again = !hist.timer; return; }
    if (hist.available === false && now() < hist.retryAt) return;
    var wait = Math.max(0, hist.last + HISTORY_GAP_MS - now());
    hist.timer = setTimeout(fetchHistory, wait);
  }

  function historyDone() {
    hist.inflight = false;
    if (hist.again) { hist.again = false; scheduleHistory(); }
  }

  function fetchHistory() {
    hist.timer = null;
    hist.inflight = true;
    hist.last = now();
    var fresh = hist.available !== true;  /* first answer, or history came back */
    var since = fresh ? 0 : hist.since;
    fetch("v1/history?since=" + since, { cache: "no-store" }).then(function (r) {
      if (!r.ok) {
        var e = new Error("HTTP " + r.status);
        e.status = r.status;
        throw e;
      }
      return r.json();
    }).then(function (j) {
      if (fresh) resetData();
      if (isNum(j.global_step) && hist.globalStep !== null && j.global_step < hist.globalStep) {
        /* the server restarted with less history: start over */
        resetData();
        hist.available = null;
        historyDone();
        scheduleHistory();
        return;
      }
      hist.available = true;
      hist.count++;
      applyHistory(j);
      historyDone();
    }).catch(function (e) {
      if (e && (e.status === 404 || e.status === 405 || e.status === 501)) {
        /* no history on this server: draw the points the status brings */
        if (hist.available !== false) resetData();
        hist.available = false;
        hist.retryAt = now() + HISTORY_RETRY_MS;
        if (lastStatus) statusPoint(lastStatus);
      }
      hist.again = false;
      hist.inflight = false;
      updateChartFoot();
    });
  }

  function applyHistory(j) {
    if (isNum(j.global_step)) hist.globalStep = j.global_step;
    var pts = Array.isArray(j.points) ? j.points : [];
    for (var i = 0; i < pts.length; i++) {
      var p = pts[i];
      if (!Array.isArray(p) || !isNum(p[0]) || !isNum(p[1])) continue;
      appendPoint(p[0], p[1], p[2]);
    }
    if (P.step.length) hist.since = Math.max(hist.since, P.step[P.step.length - 1]);
    var ev = Array.isArray(j.eval) ? j.eval : [];
    for (i = 0; i < ev.length; i++) {
      var q = ev[i];
      if (Array.isArray(q)) putEval(q[0], q[1], q[2], q[3]);
    }
    publishCounts();
    requestDraw();
  }

  /* when the server has no /v1/history: one point per status that moved */
  function statusPoint(s) {
    if (hist.available !== false || !isNum(s.global_step) || !isNum(s.last_loss)) return;
    if (appendPoint(s.global_step, s.last_loss, now() / 1000)) {
      publishCounts();
      requestDraw();
    }
  }

  /* ------------------------------------------------------------ status */

  var lastStatus = null, lastStatusAt = 0, prevStep = null, prevEvalKey = "", prevUptime = null;
  var rateSamples = [];  /* [ms, global_step] of the last ~10 s: pageRate */

  /* steps a second from global_step over the last ~10 s of statuses (a
   * pipeline stage reports no rate); null until 1 s of them is seen */
  function pageRate(step) {
    var t = now();
    if (!isNum(step)) return null;
    var last = rateSamples[rateSamples.length - 1];
    if (last && step < last[1]) rateSamples = [];  /* a new job */
    rateSamples.push([t, step]);
    while (rateSamples.length > 2 && t - rateSamples[1][0] >= 10000) rateSamples.shift();
    var first = rateSamples[0];
    return t - first[0] >= 1000 ? (step - first[1]) * 1000 / (t - first[0]) : null;
  }

  /* The empty chart's words: the history is still loading, or it has no
   * point although the status reports a loss, or no loss at all yet. */
  function emptyText() {
    if (hist.available === null || (hist.available === true && hist.count === 0)) return "loading the loss history\u2026";
    if (lastStatus && isNum(lastStatus.last_loss))
      return "no point in the loss history yet (last loss " + fmtLoss(lastStatus.last_loss) +
             (isNum(lastStatus.global_step) ? " at step " + fmtInt(lastStatus.global_step) : "") + ")";
    return "no loss reported yet";
  }
  var ageCells = [];   /* [td, secs_ago at receipt] of the workers table */

  function renderStatus(s) {
    if (!s || typeof s !== "object") return;
    lastStatus = s;
    lastStatusAt = now();

    if (isNum(s.uptime_secs)) {
      if (prevUptime !== null && s.uptime_secs + 2 < prevUptime) {
        /* psd restarted: its history starts over too */
        resetData();
        hist.available = null;
        publishCounts();
        requestDraw();
      }
      prevUptime = s.uptime_secs;
    }

    /* a pipeline stage's endpoint (mode "pipeline") says less than psd:
     * what it does not report is said so, not left blank */
    var pipe = s.mode === "pipeline";
    var task = s.task && typeof s.task === "object" && s.task.type !== undefined
      ? s.task.type + ":" + s.task.index
      : pipe && isNum(s.stage) && isNum(s.stages)
        ? "stage " + s.stage + " of " + s.stages +
          (isNum(s.replica) && isNum(s.replicas) && s.replicas > 1 ? ", replica " + s.replica + " of " + s.replicas : "")
        : DASH;
    setText("task", task);
    var mode = typeof s.mode === "string" ? s.mode : DASH;
    var m = $("mode");
    setText("mode", mode === DASH ? DASH : pipe ? "pipeline" : mode + " mode");
    m.className = "badge" + (mode === "sync" || mode === "async" || pipe ? " mode-" + mode : "");
    var opt = typeof s.optimizer === "string" ? s.optimizer : "";
    var lr = isNum(s.learning_rate) ? "lr " + fmtNum(s.learning_rate) : "";
    setText("optimizer", [opt, lr].filter(Boolean).join(" \u00b7 ") || (pipe ? "optimizer: see the stages' logs" : DASH));

    setText("global-step", fmtInt(s.global_step));
    $("global-step").setAttribute("data-value", isNum(s.global_step) ? String(s.global_step) : "");
    document.title = isNum(s.global_step) ? "restps \u00b7 step " + fmtInt(s.global_step) : "restps";
    setText("last-loss", fmtLoss(s.last_loss));
    var sps = s.steps_per_sec, spsSub = "";
    if (!isNum(sps) && pipe) {
      /* a stage reports no rate: the page's own, from global_step over time */
      sps = pageRate(s.global_step);
      spsSub = isNum(sps) ? "measured by this page" : "measuring\u2026";
    }
    setText("steps-per-sec", fmtSI(sps), isNum(sps) ? String(sps) : "");
    setText("steps-per-sec-sub", spsSub);
    setText("examples-per-sec", fmtSI(s.examples_per_sec),
            isNum(s.examples_per_sec) ? String(s.examples_per_sec) : "");
    setText("examples-per-sec-sub", !isNum(s.examples_per_sec) && pipe ? "not reported by a stage" : "");

    var ev = s.eval && typeof s.eval === "object" ? s.eval : null;
    setText("eval-loss", fmtLoss(ev && ev.loss));
    setText("eval-accuracy", fmtPct(ev && ev.accuracy));
    setText("eval-step", ev && isNum(ev.global_step) ? "at step " + fmtInt(ev.global_step) : "");
    var evalKey = ev ? [ev.global_step, ev.loss, ev.accuracy].join("/") : "";
    if (ev && putEval(ev.global_step, isNum(ev.loss) ? ev.loss : null,
                      isNum(ev.accuracy) ? ev.accuracy : null, now() / 1000)) {
      publishCounts();
      requestDraw();
    }

    var nWorkers = Array.isArray(s.workers) ? s.workers.length : (isNum(s.workers) ? s.workers : null);
    var stagesUp = null;
    if (!isNum(s.live_workers) && pipe && Array.isArray(s.pipeline)) {
      /* the stages of this replica that answer its GET /v1/pipeline */
      stagesUp = s.pipeline.filter(function (e) { return e && typeof e === "object" && e.error === undefined; }).length;
    }
    setText("live-workers", isNum(s.live_workers)
      ? fmtInt(s.live_workers) + (nWorkers !== null ? " / " + fmtInt(nWorkers) : "")
      : stagesUp !== null ? fmtInt(stagesUp) + " / " + fmtInt(s.pipeline.length) : DASH);
    setText("live-workers-sub", stagesUp !== null ? "stages answering" : "");
    setText("variables", fmtInt(s.variables));
    setText("bytes", isNum(s.bytes) ? fmtBytes(s.bytes) : !isNum(s.variables) && pipe ? "held by the stages, not reported" : "",
            isNum(s.bytes) ? fmtInt(s.bytes) + " bytes" : "");
    setText("uptime", fmtDuration(s.uptime_secs));
    setText("requests", fmtSI(s.requests_served));

    renderSync(s);
    renderPipeline(s);
    renderWorkers(s);
    renderShards(s);
    tick();

    statusPoint(s);
    if (!P.step.length && !E.step.length) requestDraw();  /* the empty chart's words follow the status */
    if (s.global_step !== prevStep || evalKey !== prevEvalKey) {
      prevStep = s.global_step;
      prevEvalKey = evalKey;
      scheduleHistory();
    }
  }

  function renderSync(s) {
    var panel = $("sync-panel");
    if (s.mode !== "sync") { panel.hidden = true; return; }
    panel.hidden = false;
    var info = [];
    if (isNum(s.replicas_to_aggregate)) info.push("aggregates " + s.replicas_to_aggregate);
    if (isNum(s.pending_gradients)) info.push(s.pending_gradients + " pending");
    if (isNum(s.global_step)) info.push("step " + fmtInt(s.global_step));
    setText("sync-info", info.join(" \u00b7 "));
    var box = $("waiting");
    box.textContent = "";
    if (!Array.isArray(s.waiting_for)) { box.textContent = DASH; return; }
    if (!s.waiting_for.length) {
      var none = document.createElement("span");
      none.className = "muted";
      none.textContent = "waiting for no worker";
      box.appendChild(none);
      return;
    }
    var label = document.createElement("span");
    label.className = "muted";
    label.textContent = "waiting for";
    box.appendChild(label);
    s.waiting_for.forEach(function (w) {
      var c = document.createElement("span");
      c.className = "chip";
      c.textContent = "worker " + (isNum(w) ? w : DASH);
      box.appendChild(c);
    });
  }

  function cell(tr, text, cls) {
    var td = document.createElement("td");
    td.textContent = text;
    if (cls) td.className = cls;
    tr.appendChild(td);
    return td;
  }

  function countCell(tr, n, cls) {
    var td = cell(tr, fmtCount(n), cls);
    if (isNum(n) && Math.abs(n) >= 1e7) td.title = fmtInt(n);
    return td;
  }

  function emptyRow(body, text) {
    var tr = document.createElement("tr");
    var td = cell(tr, text, "muted");
    td.colSpan = 5;
    body.appendChild(tr);
  }

  /* A pipeline stage's chief (GET /v1/status, mode "pipeline"): every stage
   * of its replica as that stage's GET /v1/pipeline says, busy and idle time */
  function renderPipeline(s) {
    var panel = $("pipeline-panel");
    if (s.mode !== "pipeline" || !Array.isArray(s.pipeline)) { panel.hidden = true; return; }
    panel.hidden = false;
    setText("pipeline-info", (isNum(s.stages) ? s.stages + " stages" : "") +
            (isNum(s.replicas) ? " \u00b7 " + s.replicas + (s.replicas === 1 ? " replica" : " replicas") : ""));
    var frag = document.createDocumentFragment();
    s.pipeline.forEach(function (st) {
      st = st || {};
      var tr = document.createElement("tr");
      cell(tr, isNum(st.stage) ? String(st.stage) : DASH);
      if (typeof st.error === "string") {
        var td = cell(tr, st.error, "muted");
        td.colSpan = 7;
        frag.appendChild(tr);
        return;
      }
      countCell(tr, st.current_step, "num");
      cell(tr, isNum(st.current_slot) ? String(st.current_slot) : DASH, "num");
      var w = st.waiting_for;
      cell(tr, st.done ? "done" : w && typeof w === "object"
           ? w.dir + " of step " + w.step + (isNum(w.micro_batch) ? ", micro-batch " + w.micro_batch : "") +
             " from stage " + w.from_stage : "computing");
      cell(tr, fmtNum(st.busy_secs), "num");
      cell(tr, fmtNum(st.idle_secs), "num");
      var tot = (st.busy_secs || 0) + (st.idle_secs || 0);
      cell(tr, isNum(st.busy_secs) && isNum(st.idle_secs) && tot > 0 ? Math.round(100 * st.idle_secs / tot) + "%" : DASH,
           "num");
      countCell(tr, st.buffered, "num");
      frag.appendChild(tr);
    });
    var body = $("pipeline-stages");
    body.textContent = "";
    body.appendChild(frag);
  }

  function renderWorkers(s) {
    var body = $("workers");
    var frag = document.createDocumentFragment();
    ageCells = [];
    if (!Array.isArray(s.workers)) {
      emptyRow(frag, s.mode === "pipeline" ? "a stage reports no workers: its replica's stages are above" : DASH);
      setText("workers-info", "");
    } else if (!s.workers.length) {
      emptyRow(frag, "no worker has pushed yet");
      setText("workers-info", "");
    } else {
      var ws = s.workers.slice().sort(function (a, b) { return (a && a.worker) - (b && b.worker); });
      var stale = 0;
      ws.forEach(function (w) {
        w = w || {};
        var tr = document.createElement("tr");
        cell(tr, isNum(w.worker) ? String(w.worker) : DASH);
        countCell(tr, w.last_step, "num");
        var td = cell(tr, fmtAge(w.last_seen_secs_ago));
        if (isNum(w.last_seen_secs_ago)) ageCells.push([td, w.last_seen_secs_ago]);
        countCell(tr, w.pushes, "num");
        countCell(tr, w.stale_dropped, "num" + (w.stale_dropped > 0 ? " stale" : ""));
        if (isNum(w.stale_dropped)) stale += w.stale_dropped;
        frag.appendChild(tr);
      });
      setText("workers-info", ws.length + (ws.length === 1 ? " worker" : " workers") +
              (stale ? " \u00b7 " + fmtInt(stale) + " stale dropped" : ""));
    }
    body.textContent = "";
    body.appendChild(frag);
  }

  function renderShards(s) {
    var body = $("shards");
    var frag = document.createDocumentFragment();
    if (!Array.isArray(s.shards) || !s.shards.length) {
      emptyRow(frag, s.mode === "pipeline" ? "a stage reports no ps shards (with the ps, ps 0's page shows them)" : DASH);
    } else {
      s.shards.forEach(function (sh) {
        sh = sh || {};
        var tr = document.createElement("tr");
        cell(tr, isNum(sh.task) ? "ps:" + sh.task : DASH);
        cell(tr, typeof sh.address === "string" ? sh.address : DASH, "addr");
        if (sh.up === true) cell(tr, "up", "up");
        else if (sh.up === false) cell(tr, "down", "down");
        else cell(tr, DASH);
        countCell(tr, sh.variables, "num");
        var td = cell(tr, fmtBytes(sh.bytes), "num");
        if (isNum(sh.bytes)) td.title = fmtInt(sh.bytes) + " bytes";
        frag.appendChild(tr);
      });
    }
    body.textContent = "";
    body.appendChild(frag);
  }

  /* once a second: the ages move on between updates */
  function tick() {
    if (!lastStatus) return;
    var dt = (now() - lastStatusAt) / 1000;
    setText("updated", "updated " + fmtAge(dt));
    for (var i = 0; i < ageCells.length; i++) {
      var t = fmtAge(ageCells[i][1] + dt);
      if (ageCells[i][0].textContent !== t) ageCells[i][0].textContent = t;
    }
    if (isNum(lastStatus.uptime_secs)) setText("uptime", fmtDuration(lastStatus.uptime_secs + dt));
  }

  /* ------------------------------------------------------------ connection */

  var conn = { es: null, errors: 0, pollTimer: null, retryTimer: null, polling: false, pollBusy: false };

  function setConn(state, text) {
    var el = $("conn");
    el.className = "badge conn conn-" + state;
    setText("conn", text);
  }

  function onEvent(ev) {
    conn.errors = 0;
    var s;
    try { s = JSON.parse(ev.data); } catch (e) { return; }
    if (conn.polling) stopPolling();
    setConn("live", "live");
    renderStatus(s);
  }

  function startEvents() {
    if (!window.EventSource) { startPolling(); return; }
    var es;
    try { es = new EventSource("v1/events"); } catch (e) { startPolling(); return; }
    conn.es = es;
    es.addEventListener("status", onEvent);
    es.onmessage = onEvent;
    /* on an error, poll /v1/status while the browser reconnects; after
     * SSE_MAX_ERRORS in a row (or when it gives up) stop it and only poll,
     * trying events again every SSE_RETRY_MS; the first event stops polling */
    es.onerror = function () {
      conn.errors++;
      if (es.readyState === 2 /* CLOSED */ || conn.errors >= SSE_MAX_ERRORS) {
        es.close();
        if (conn.es === es) conn.es = null;
      }
      startPolling();
    };
  }

  function startPolling() {
    if (!conn.polling) {
      conn.polling = true;
      setConn("poll", "polling every " + POLL_MS / 1000 + " s");
      poll();
      conn.pollTimer = setInterval(poll, POLL_MS);
    }
    if (!conn.retryTimer) {
      conn.retryTimer = setTimeout(function () {
        conn.retryTimer = null;
        conn.errors = 0;
        if (!conn.es) startEvents();
      }, SSE_RETRY_MS);
    }
  }

  function stopPolling() {
    conn.polling = false;
    clearInterval(conn.pollTimer);
    conn.pollTimer = null;
  }

  function poll() {
    if (conn.pollBusy) return;
    conn.pollBusy = true;
    fetch("v1/status", { cache: "no-store" }).then(function (r) {
      if (!r.ok) throw new Error("HTTP " + r.status);
      return r.json();
    }).then(function (s) {
      conn.pollBusy = false;
      if (conn.polling) setConn("poll", "polling every " + POLL_MS / 1000 + " s");
      renderStatus(s);
    }).catch(function () {
      conn.pollBusy = false;
      if (conn.polling) setConn("down", "server unreachable");
    });
  }

  /* ------------------------------------------------------------ the step timeline */

  /* GET /v1/timeline every second: each worker's last steps as bars by kind
   * (pull, wait, compute, push), one row a worker, the window the last
   * TL_STEPS steps of the slowest worker (10 s at most). Bars are SVG rects
   * with their kind, worker and step in data- attributes and a title. */
  var TL_MS = 1000, TL_STEPS = 8, TL_ROW = 18, TL_LABEL = 72;
  var SVGNS = "http://www.w3.org/2000/svg";
  var tl = { busy: false, timer: null };

  /* [from, to]: to, the latest span's end (spans come a heartbeat late);
   * from, where the last TL_STEPS steps of the slowest worker begin */
  function tlWindow(t) {
    var to = -Infinity;
    t.workers.forEach(function (w) {
      w.spans.forEach(function (sp) { if (isNum(sp.end) && sp.end > to) to = sp.end; });
    });
    if (!isFinite(to)) to = t.now;
    var from = to;
    t.workers.forEach(function (w) {
      var starts = {}, steps = [];
      w.spans.forEach(function (sp) {
        if (!(sp.step in starts)) { starts[sp.step] = sp.start; steps.push(sp.step); }
        else if (sp.start < starts[sp.step]) starts[sp.step] = sp.start;
      });
      steps.sort(function (a, b) { return a - b; });
      var k = steps[Math.max(0, steps.length - TL_STEPS)];
      if (k !== undefined && starts[k] < from) from = starts[k];
    });
    return [Math.max(from, to - 10), to];
  }

  function svgEl(name, attrs) {
    var e = document.createElementNS(SVGNS, name);
    for (var k in attrs) e.setAttribute(k, attrs[k]);
    return e;
  }

  function renderTimeline(t) {
    var panel = $("timeline-panel"), svg = $("timeline");
    if (!t || !Array.isArray(t.workers) || !t.workers.length || !isNum(t.now)) { panel.hidden = true; return; }
    panel.hidden = false;
    var win = tlWindow(t), from = win[0], to = win[1], span = Math.max(to - from, 1e-3);
    var width = Math.max(svg.clientWidth || 600, 200), plot = width - TL_LABEL - 8;
    var height = t.workers.length * TL_ROW + 16;
    svg.setAttribute("viewBox", "0 0 " + width + " " + height);
    svg.setAttribute("height", height);
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    var bars = 0;
    t.workers.forEach(function (w, row) {
      var y = row * TL_ROW;
      var label = svgEl("text", { x: 0, y: y + 13 });
      label.textContent = "worker " + w.worker;
      svg.appendChild(label);
      w.spans.forEach(function (sp) {
        if (!isNum(sp.start) || !isNum(sp.end) || sp.end < from || sp.start > to) return;
        var x0 = TL_LABEL + plot * (Math.max(sp.start, from) - from) / span;
        var x1 = TL_LABEL + plot * (Math.min(sp.end, to) - from) / span;
        var r = svgEl("rect", { x: x0.toFixed(1), y: y + 2, width: Math.max(x1 - x0, 0.5).toFixed(1),
                                height: TL_ROW - 4, "class": "tl-" + sp.kind, "data-kind": sp.kind,
                                "data-worker": w.worker, "data-step": sp.step });
        var tip = svgEl("title", {});
        tip.textContent = "worker " + w.worker + " \u00b7 step " + sp.step + " \u00b7 " + sp.kind + " " +
          fmtNum((sp.end - sp.start) * 1e3) + " ms" + (sp["for"] ? " for " + sp["for"] : "");
        r.appendChild(tip);
        svg.appendChild(r);
        bars++;
      });
    });
    var axis = svgEl("line", { x1: TL_LABEL, x2: TL_LABEL + plot, y1: height - 14, y2: height - 14, "class": "tl-axis" });
    svg.appendChild(axis);
    var ago = Math.max(0, t.now - to);
    var left = svgEl("text", { x: TL_LABEL, y: height - 2 });
    left.textContent = "-" + fmtNum(span + ago) + " s";
    svg.appendChild(left);
    var right = svgEl("text", { x: TL_LABEL + plot, y: height - 2, "text-anchor": "end" });
    right.textContent = ago < 1.5 ? "now" : "-" + fmtNum(ago) + " s";
    svg.appendChild(right);
    svg.setAttribute("data-bars", bars);
    setText("timeline-info", fmtNum(span) + " s, the last " + TL_STEPS + " steps of " + t.workers.length +
            (t.workers.length === 1 ? " worker" : " workers"));
  }

  function fetchTimeline() {
    tl.timer = setTimeout(fetchTimeline, TL_MS);
    /* psd's route (a ring's or a pipeline's chief serves the page without it) */
    var st = lastStatus;
    if (tl.busy || document.hidden || !st || !st.task || st.task.type !== "ps") return;
    tl.busy = true;
    fetch("v1/timeline?secs=10", { cache: "no-store" }).then(function (r) {
      return r.ok ? r.json() : null;
    }).then(function (t) {
      tl.busy = false;
      renderTimeline(t);
    }).catch(function () { tl.busy = false; });
  }

  /* ------------------------------------------------------------ the chart */

  var canvas = $("chart");
  var ctx = canvas.getContext("2d");
  var draw = { timer: null, last: 0, count: 0 };

  function requestDraw() {
    if (draw.timer) return;
    var wait = Math.max(0, draw.last + DRAW_GAP_MS - now());
    draw.timer = setTimeout(function () {
      draw.timer = null;
      if (document.hidden) { draw.pending = true; return; }
      drawChart();
    }, wait);
  }

  document.addEventListener("visibilitychange", function () {
    if (!document.hidden && draw.pending) { draw.pending = false; requestDraw(); }
  });
  window.addEventListener("resize", requestDraw);
  if (window.ResizeObserver) new ResizeObserver(function () { requestDraw(); }).observe(canvas);
  if (window.matchMedia) {
    var mq = window.matchMedia("(prefers-color-scheme: dark)");
    if (mq.addEventListener) mq.addEventListener("change", requestDraw);
  }

  /* about `count` round ticks covering [lo, hi] */
  function ticks(lo, hi, count) {
    var span = hi - lo;
    if (!(span > 0)) return { step: 1, list: [lo] };
    var raw = span / Math.max(1, count), mag = Math.pow(10, Math.floor(Math.log10(raw)));
    var f = raw / mag, step = (f < 1.5 ? 1 : f < 3 ? 2 : f < 7 ? 5 : 10) * mag;
    var list = [];
    for (var v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) list.push(v);
    return { step: step, list: list };
  }

  function tickLabel(v, step) {
    if (Math.abs(v) < step * 1e-6) return "0";
    var a = Math.abs(v);
    if (a >= 1e4 && step >= 1) {
      /* 250k, 1.5M; exact digits when the ticks are closer than that */
      var u = a >= 1e9 ? 1e9 : a >= 1e6 ? 1e6 : 1e3, sfx = u === 1e9 ? "G" : u === 1e6 ? "M" : "k";
      var d = Math.max(0, Math.ceil(Math.log10(u / step) - 1e-9));
      if (d <= 1) return (v / u).toFixed(d) + sfx;
      return fmtInt(v);
    }
    if (a >= 1000 && step >= 1) return fmtInt(v);
    var d = Math.max(0, Math.min(6, -Math.floor(Math.log10(step))));
    return v.toFixed(d);
  }

  function colors() {
    var cs = getComputedStyle(document.documentElement);
    function c(name, dflt) { return (cs.getPropertyValue(name) || "").trim() || dflt; }
    return { fg: c("--muted", "#666"), grid: c("--grid", "#eee"), line: c("--line", "#ccc"),
             raw: c("--raw", "#9bd"), ema: c("--ema", "#15c"), ev: c("--eval", "#d40"),
             acc: c("--acc", "#292") };
  }

  function drawChart() {
    var t0 = performance.now();
    draw.last = now();
    var rect = canvas.getBoundingClientRect();
    var dpr = window.devicePixelRatio || 1;
    var W = Math.max(1, Math.round(rect.width)), H = Math.max(1, Math.round(rect.height));
    var pw = Math.round(W * dpr), ph = Math.round(H * dpr);
    if (canvas.width !== pw || canvas.height !== ph) { canvas.width = pw; canvas.height = ph; }
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, W, H);

    var n = P.step.length, ne = E.step.length;
    $("chart-empty").hidden = n + ne > 0;
    if (!n && !ne) setText("chart-empty", emptyText());
    updateChartFoot();
    if (!n && !ne) { finishDraw(t0, 0); return; }

    var C = colors();
    var i, x0 = Infinity, x1 = -Infinity, y0 = Infinity, y1 = -Infinity;
    if (n) {
      x0 = P.step[0]; x1 = P.step[n - 1];
      for (i = 0; i < n; i++) {
        var l = P.loss[i];
        if (l < y0) y0 = l;
        if (l > y1) y1 = l;
      }
    }
    var hasAcc = false, a0 = Infinity, a1 = -Infinity;
    for (i = 0; i < ne; i++) {
      if (E.step[i] < x0) x0 = E.step[i];
      if (E.step[i] > x1) x1 = E.step[i];
      if (isNum(E.loss[i])) { y0 = Math.min(y0, E.loss[i]); y1 = Math.max(y1, E.loss[i]); }
      if (isNum(E.acc[i])) { hasAcc = true; a0 = Math.min(a0, E.acc[i]); a1 = Math.max(a1, E.acc[i]); }
    }
    if (!isFinite(y0)) { y0 = 0; y1 = 1; }
    if (x1 <= x0) { x0 -= 1; x1 += 1; }
    if (y1 <= y0) { var d = Math.abs(y0) * 0.1 || 1; y0 -= d; y1 += d; }
    var pad = (y1 - y0) * 0.05;
    y0 -= pad; y1 += pad;
    if (hasAcc) {
      a0 = Math.max(0, Math.floor(a0 * 20) / 20 - 0.05);
      a1 = Math.min(1, Math.ceil(a1 * 20) / 20 + 0.05);
      if (a1 <= a0) { a0 = 0; a1 = 1; }
    }

    var small = W < 500;
    ctx.font = (small ? 11 : 12) + "px system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif";
    var yt = ticks(y0, y1, small ? 4 : 6);
    var yl = yt.list.map(function (v) { return tickLabel(v, yt.step); });
    var lw = 0;
    for (i = 0; i < yl.length; i++) lw = Math.max(lw, ctx.measureText(yl[i]).width);
    var at = hasAcc ? ticks(a0, a1, small ? 4 : 5) : null;
    var al = at ? at.list.map(function (v) { return Math.round(v * 100) + "%"; }) : [];
    var rw = 0;
    for (i = 0; i < al.length; i++) rw = Math.max(rw, ctx.measureText(al[i]).width);

    var L = Math.ceil(lw) + 10, R = W - (hasAcc ? Math.ceil(rw) + 10 : 12), T = 26, B = H - 34;
    if (R - L < 20 || B - T < 20) { finishDraw(t0, 0); return; }
    var sx = (R - L) / (x1 - x0), sy = (B - T) / (y1 - y0);
    function X(v) { return L + (v - x0) * sx; }
    function Y(v) { return B - (v - y0) * sy; }

    /* grid and axes */
    ctx.lineWidth = 1;
    ctx.strokeStyle = C.grid;
    ctx.fillStyle = C.fg;
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    ctx.beginPath();
    for (i = 0; i < yt.list.length; i++) {
      var yy = Math.round(Y(yt.list[i])) + 0.5;
      ctx.moveTo(L, yy); ctx.lineTo(R, yy);
      ctx.fillText(yl[i], L - 5, yy);
    }
    /* x ticks: as many as fit their labels side by side */
    var xt, xl, xw, want = Math.max(2, Math.floor((R - L) / (small ? 60 : 90)));
    for (;;) {
      xt = ticks(x0, x1, want);
      if (xt.step < 1) xt = ticks(x0, x1, Math.max(1, Math.floor(x1 - x0)));
      xl = xt.list.map(function (v) { return tickLabel(v, Math.max(1, xt.step)); });
      xw = 0;
      for (i = 0; i < xl.length; i++) xw = Math.max(xw, ctx.measureText(xl[i]).width);
      if (want <= 1 || xt.list.length < 2 || xt.step * sx >= xw + 12) break;
      want--;
    }
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    for (i = 0; i < xt.list.length; i++) {
      var xx = Math.round(X(xt.list[i])) + 0.5;
      ctx.moveTo(xx, T); ctx.lineTo(xx, B);
      var half = ctx.measureText(xl[i]).width / 2;
      ctx.fillText(xl[i], Math.min(W - half - 1, Math.max(half + 1, xx)), B + 4);
    }
    ctx.stroke();
    ctx.strokeStyle = C.line;
    ctx.beginPath();
    ctx.moveTo(L + 0.5, T); ctx.lineTo(L + 0.5, B + 0.5); ctx.lineTo(R, B + 0.5);
    ctx.stroke();
    ctx.textAlign = "left";
    ctx.fillText("loss", 2, 2);
    ctx.textAlign = "right";
    ctx.textBaseline = "bottom";
    ctx.fillText("global step", R, H - 1);
    if (hasAcc) {
      ctx.textAlign = "left";
      ctx.textBaseline = "middle";
      var sa = (B - T) / (a1 - a0);
      for (i = 0; i < at.list.length; i++) ctx.fillText(al[i], R + 5, B - (at.list[i] - a0) * sa);
      ctx.textBaseline = "top";
      ctx.textAlign = "right";
      ctx.fillText("accuracy", W - 2, 2);
    }

    ctx.save();
    ctx.beginPath();
    ctx.rect(L, T - 2, R - L, B - T + 4);
    ctx.clip();

    /* raw points: a line, or each pixel column's min..max when they are dense */
    var cols = Math.max(1, Math.round(R - L));
    ctx.strokeStyle = C.raw;
    ctx.lineWidth = 1;
    ctx.beginPath();
    if (n > cols * 2) {
      var col = null, mn = 0, mx = 0, started = false;
      var band = function () {
        if (started) ctx.lineTo(col + 0.5, mn); else { ctx.moveTo(col + 0.5, mn); started = true; }
        ctx.lineTo(col + 0.5, mx + 0.5);
      };
      for (i = 0; i < n; i++) {
        var c = Math.floor(X(P.step[i])), yv = Y(P.loss[i]);
        if (c !== col) {
          if (col !== null) band();
          col = c; mn = mx = yv;
        } else {
          if (yv < mn) mn = yv;
          if (yv > mx) mx = yv;
        }
      }
      band();
    } else {
      for (i = 0; i < n; i++) {
        if (i === 0) ctx.moveTo(X(P.step[i]), Y(P.loss[i]));
        else ctx.lineTo(X(P.step[i]), Y(P.loss[i]));
      }
    }
    ctx.stroke();
    if (n > 0 && n <= cols / 6) {
      ctx.fillStyle = C.raw;
      for (i = 0; i < n; i++) {
        ctx.beginPath();
        ctx.arc(X(P.step[i]), Y(P.loss[i]), 2, 0, 2 * Math.PI);
        ctx.fill();
      }
    }

    /* the moving average: one vertex per pixel column at most */
    ctx.strokeStyle = C.ema;
    ctx.lineWidth = 2.25;
    ctx.lineJoin = "round";
    ctx.beginPath();
    var lastCol = -Infinity;
    for (i = 0; i < n; i++) {
      var px = X(P.step[i]);
      if (i !== n - 1 && px - lastCol < 1) continue;
      lastCol = px;
      if (i === 0) ctx.moveTo(px, Y(P.ema[i])); else ctx.lineTo(px, Y(P.ema[i]));
    }
    if (n === 1) ctx.lineTo(X(P.step[0]) + 0.01, Y(P.ema[0]));
    ctx.stroke();

    /* evaluations: test loss (dots) and accuracy (right axis) */
    if (ne) {
      ctx.lineWidth = 1.5;
      ctx.strokeStyle = C.ev;
      ctx.fillStyle = C.ev;
      ctx.beginPath();
      var first = true;
      for (i = 0; i < ne; i++) {
        if (!isNum(E.loss[i])) continue;
        if (first) { ctx.moveTo(X(E.step[i]), Y(E.loss[i])); first = false; }
        else ctx.lineTo(X(E.step[i]), Y(E.loss[i]));
      }
      ctx.stroke();
      var dense = ne > (R - L) / 10, mr = dense ? 2 : 3.5;
      for (i = 0; i < ne; i++) {
        if (!isNum(E.loss[i])) continue;
        ctx.beginPath();
        ctx.arc(X(E.step[i]), Y(E.loss[i]), mr, 0, 2 * Math.PI);
        ctx.fill();
      }
      if (hasAcc) {
        var sa2 = (B - T) / (a1 - a0);
        ctx.strokeStyle = C.acc;
        ctx.fillStyle = C.acc;
        ctx.setLineDash([5, 3]);
        ctx.beginPath();
        first = true;
        for (i = 0; i < ne; i++) {
          if (!isNum(E.acc[i])) continue;
          var ay = B - (E.acc[i] - a0) * sa2;
          if (first) { ctx.moveTo(X(E.step[i]), ay); first = false; } else ctx.lineTo(X(E.step[i]), ay);
        }
        ctx.stroke();
        ctx.setLineDash([]);
        for (i = 0; i < ne; i++) {
          if (!isNum(E.acc[i])) continue;
          ctx.fillRect(X(E.step[i]) - mr + 0.5, B - (E.acc[i] - a0) * sa2 - mr + 0.5, 2 * mr - 1, 2 * mr - 1);
        }
      }
    }
    ctx.restore();
    finishDraw(t0, n);
  }

  function finishDraw(t0, n) {
    draw.count++;
    canvas.setAttribute("data-draws", String(draw.count));
    canvas.setAttribute("data-drawn-points", String(n));
    canvas.setAttribute("data-draw-ms", (performance.now() - t0).toFixed(1));
  }

  function updateChartFoot() {
    var n = P.step.length, parts = [];
    if (n) {
      parts.push(fmtInt(n) + (n === 1 ? " point" : " points") + ", steps " +
                 fmtInt(P.step[0]) + "\u2013" + fmtInt(P.step[n - 1]));
      parts.push("last loss " + fmtLoss(P.loss[n - 1]) + ", smoothed " + fmtLoss(P.ema[n - 1]));
    }
    if (E.step.length) parts.push(E.step.length + (E.step.length === 1 ? " evaluation" : " evaluations"));
    if (hist.available === false) parts.push("no /v1/history on this server: points from live status only");
    setText("chart-foot", parts.join(" \u00b7 "));
  }

  /* hover: the nearest point's numbers under the chart */
  canvas.addEventListener("mousemove", function (e) {
    var n = P.step.length;
    if (!n) return;
    var rect = canvas.getBoundingClientRect();
    var f = (e.clientX - rect.left) / Math.max(1, rect.width);
    var target = P.step[0] + f * (P.step[n - 1] - P.step[0]);
    var lo = 0, hi = n - 1;
    while (lo < hi) { var mid = (lo + hi) >> 1; if (P.step[mid] < target) lo = mid + 1; else hi = mid; }
    setText("chart-foot", "step " + fmtInt(P.step[lo]) + ": loss " + fmtLoss(P.loss[lo]) +
            ", smoothed " + fmtLoss(P.ema[lo]));
  });
  canvas.addEventListener("mouseleave", updateChartFoot);

  /* for tests and the console: copies of the points held */
  window.restps = {
    points: function () { return { step: P.step.slice(), loss: P.loss.slice(), ema: P.ema.slice() }; },
    evals: function () { return { step: E.step.slice(), loss: E.loss.slice(), acc: E.acc.slice() }; },
    /* take an answer shaped like /v1/history's, or a status object, as if
     * the server sent it */
    feed: function (j) { applyHistory(j); return P.step.length; },
    render: function (s) { renderStatus(s); },
    timeline: function (t) { renderTimeline(t); return $("timeline").getAttribute("data-bars"); },
    fmt: { int: fmtInt, si: fmtSI, bytes: fmtBytes, loss: fmtLoss, pct: fmtPct, age: fmtAge,
           duration: fmtDuration }
  };

  /* ------------------------------------------------------------ start */

  setInterval(tick, 1000);
  fetch("v1/status", { cache: "no-store" }).then(function (r) {
    return r.ok ? r.json() : null;
  }).then(function (s) {
    if (s && !lastStatus) renderStatus(s);
  }).catch(function () {});
  scheduleHistory();
  fetchTimeline();
  startEvents();
  requestDraw();
}());
