// The live panel: polls /v1/stats, shows its numbers, derives rates between polls (decode tok/s,
// hit rate, bytes read per token, stall per step), draws the last minutes, and says in words
// whether the expert cache or the disk holds decode back.

export const POLL_MS = 1000;
export const HISTORY_S = 300; // the charts span the last 5 minutes
export const WINDOW_S = 10; // the "live" numbers cover the last 10 seconds
// Expert reads are not what limits decode while they stall less than this share of a step.
export const COMPUTE_SHARE = 0.15;
// Below this hit rate most reads are experts that a larger cache would have kept.
export const LOW_HIT_RATE = 0.8;

const UNITS = ["B", "KB", "MB", "GB", "TB"];

export function formatBytes(n) {
  if (n == null || !Number.isFinite(n)) return "—";
  let i = 0;
  while (Math.abs(n) >= 1000 && i < UNITS.length - 1) {
    n /= 1000;
    i++;
  }
  return `${n.toFixed(i === 0 ? 0 : Math.abs(n) < 10 ? 2 : Math.abs(n) < 100 ? 1 : 0)} ${UNITS[i]}`;
}

export const formatPct = (x) => (x == null || !Number.isFinite(x) ? "—" : `${(100 * x).toFixed(1)}%`);
export const formatMs = (x) => (x == null || !Number.isFinite(x) ? "—" : `${x < 10 ? x.toFixed(2) : x.toFixed(1)} ms`);
export const formatTps = (x) => (x == null || !Number.isFinite(x) ? "—" : `${x.toFixed(1)} tok/s`);

/** The cumulative counters of one /v1/stats answer at time `t` (ms); null fields when the engine
 * reports no such counter. */
export function counters(stats, t) {
  const e = stats?.engine ?? {};
  const totals = e.totals ?? {};
  return {
    t,
    steps: e.decode_steps ?? null,
    bytes: totals.bytes_read ?? null,
    hits: totals.hits ?? null,
    misses: totals.misses ?? null,
    stall: totals.stall_ms ?? null,
  };
}

function delta(a, b) {
  return {
    steps: b.steps - a.steps,
    seconds: (b.t - a.t) / 1000,
    hits: b.hits - a.hits,
    misses: b.misses - a.misses,
    bytes: b.bytes - a.bytes,
    stall: b.stall - a.stall,
  };
}

function derive(d) {
  if (!(d.steps > 0) || !(d.seconds > 0)) return null;
  const lookups = d.hits + d.misses;
  return {
    steps: d.steps,
    seconds: d.seconds,
    tps: d.steps / d.seconds,
    hitRate: lookups > 0 ? d.hits / lookups : null,
    bytesPerToken: d.bytes / d.steps,
    stallPerStep: d.stall / d.steps,
  };
}

/** Rates between two counter samples: decode tok/s over the wall time between them, and per
 * decoded token the hit rate, expert bytes read and stall (prefill reads and stalls included,
 * as the engine's own stall_ms_per_step counts them). null when nothing was decoded. */
export function rates(a, b) {
  if (!a || !b || a.steps == null || b.steps == null) return null;
  return derive(delta(a, b));
}

/** Rates over the polls after `since` (ms) in which something was decoded; polls with nothing
 * decoded are left out, so idle time does not dilute tok/s. null when nothing was decoded. */
export function activeRates(samples, since) {
  const sum = { steps: 0, seconds: 0, hits: 0, misses: 0, bytes: 0, stall: 0 };
  for (let i = 1; i < samples.length; i++) {
    const [a, b] = [samples[i - 1], samples[i]];
    if (b.t <= since || a.steps == null || b.steps == null) continue;
    const d = delta(a, b);
    if (d.steps > 0) for (const k in sum) sum[k] += d[k];
  }
  return derive(sum);
}

/** Where decode time goes, in words, from `tps`, `stallPerStep`, `hitRate`, `bytesPerToken` and
 * the memory numbers `cacheBytes`, `availableBytes`. Returns {kind, text}; kind is one of
 * "idle", "compute", "cache", "disk". */
export function verdict(v) {
  if (!v || !(v.tps > 0) || v.stallPerStep == null) {
    return { kind: "idle", text: "Nothing decoded lately: send a message to see where the time goes." };
  }
  const stepMs = 1000 / v.tps;
  const share = Math.min(1, v.stallPerStep / stepMs);
  const wait = `decode waits ${formatMs(v.stallPerStep)} per step for expert reads (${formatPct(share)} of a ${formatMs(stepMs)} step)`;
  if (share < COMPUTE_SHARE) {
    return { kind: "compute", text: `Compute-bound: ${wait}. Neither the expert cache nor the disk holds decode back.` };
  }
  const reads = `${formatBytes(v.bytesPerToken)} per token (${formatBytes(v.bytesPerToken * v.tps)}/s)`;
  const room = v.availableBytes != null && v.cacheBytes != null && v.availableBytes >= v.cacheBytes;
  if (v.hitRate != null && v.hitRate < LOW_HIT_RATE && room) {
    return {
      kind: "cache",
      text:
        `The expert cache is the bottleneck: only ${formatPct(v.hitRate)} of expert lookups hit, so ${wait}, ` +
        `reading ${reads}. ${formatBytes(v.availableBytes)} of memory is available: a larger --expert-cache ` +
        `(now ${formatBytes(v.cacheBytes)}) would keep more experts.`,
    };
  }
  const why =
    v.hitRate != null && v.hitRate >= LOW_HIT_RATE
      ? `although ${formatPct(v.hitRate)} of expert lookups hit the cache`
      : `and there is no memory for a larger cache (${formatBytes(v.availableBytes)} available)`;
  return {
    kind: "disk",
    text: `The disk is the bottleneck: ${wait}, reading ${reads}, ${why}. Faster storage, or the pre-router's prefetch, would help.`,
  };
}

function drawChart(canvas, points, format, spanMs) {
  const dpr = window.devicePixelRatio || 1;
  const w = Math.max(1, Math.round(canvas.clientWidth * dpr));
  const h = Math.max(1, Math.round(canvas.clientHeight * dpr));
  if (canvas.width !== w || canvas.height !== h) [canvas.width, canvas.height] = [w, h];
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, w, h);
  const style = getComputedStyle(canvas);
  const now = performance.now();
  const values = points.filter((p) => p.v != null).map((p) => p.v);
  const max = Math.max(...values, 0) * 1.15 || 1;
  ctx.strokeStyle = style.borderTopColor;
  ctx.lineWidth = 1;
  ctx.strokeRect(0.5, 0.5, w - 1, h - 1);
  // One bar per poll that decoded something; gaps are polls that did not.
  ctx.fillStyle = style.color;
  const bar = Math.max(2 * dpr, (POLL_MS / spanMs) * w - dpr);
  for (const p of points) {
    if (p.v == null) continue;
    const x = w - ((now - p.t) / spanMs) * w;
    const y = h - (p.v / max) * (h - 4 * dpr) - 2 * dpr;
    ctx.fillRect(x - bar, y, bar, h - y);
  }
  ctx.fillStyle = style.color;
  ctx.font = `${10 * dpr}px system-ui, sans-serif`;
  if (values.length) ctx.fillText(`max ${format(Math.max(...values))}`, 4 * dpr, 12 * dpr);
  const last = values.length ? format(values[values.length - 1]) : "no decoding";
  const span = spanMs >= 120000 ? `${Math.round(spanMs / 60000)} minutes` : `${Math.round(spanMs / 1000)} seconds`;
  canvas.setAttribute("aria-label", `${canvas.dataset.label}, last ${span}: latest ${last}`);
}

/** The panel in `root`: call start() to poll; `onAuth` runs when the server answers 401. */
export class StatsPanel {
  constructor(root, getJSON, onAuth) {
    this.root = root;
    this.getJSON = getJSON;
    this.onAuth = onAuth;
    this.samples = [];
    this.latest = null; // the last /v1/stats answer
    this.reply = null; // numbers of the last reply, for the verdict when nothing decodes now
    this.timer = null;
    for (const canvas of root.querySelectorAll("canvas")) canvas.dataset.label = canvas.getAttribute("aria-label");
    root.querySelector("#window-s").textContent = WINDOW_S;
  }

  start() {
    if (this.timer === null) this.poll();
  }

  async snapshot() {
    const stats = await this.getJSON("/v1/stats");
    return { stats, counters: counters(stats, performance.now()) };
  }

  async poll() {
    this.timer = 0;
    try {
      const { stats, counters: c } = await this.snapshot();
      const last = this.samples[this.samples.length - 1];
      if (last && c.steps != null && last.steps != null && c.steps < last.steps) this.samples = []; // restarted
      this.samples.push(c);
      while (this.samples.length && this.samples[0].t < c.t - HISTORY_S * 1000) this.samples.shift();
      this.latest = stats;
      this.render(stats);
      this.note("");
    } catch (e) {
      if (e.status === 401) {
        this.timer = null;
        this.onAuth?.();
        return;
      }
      this.note(`Statistics unavailable: ${e.message}`);
    }
    this.timer = setTimeout(() => this.poll(), document.hidden ? 5 * POLL_MS : POLL_MS);
  }

  note(text) {
    this.root.querySelector("#stats-note").textContent = text;
  }

  set(name, value, text) {
    for (const node of this.root.querySelectorAll(`[data-metric="${name}"]`)) {
      node.textContent = text ?? (value == null ? "—" : String(value));
      if (value == null) delete node.dataset.value;
      else node.dataset.value = String(value);
    }
  }

  /** The numbers of a reply: tokens and times measured here, counters from /v1/stats before and after. */
  showReply(reply) {
    const r = rates(reply.before, reply.after);
    this.reply = { ...r, tps: reply.tps, cacheBytes: reply.cacheBytes, availableBytes: reply.availableBytes };
    this.set("reply_ttft", reply.ttftMs, formatMs(reply.ttftMs));
    this.set("reply_tps", reply.tps, formatTps(reply.tps));
    this.set("reply_tokens", reply.tokens);
    const cached = reply.cachedTokens == null ? "" : ` (${reply.cachedTokens})`;
    this.set("reply_prompt", reply.promptTokens, reply.promptTokens == null ? "—" : `${reply.promptTokens}${cached}`);
    this.set("reply_hit_rate", r?.hitRate, formatPct(r?.hitRate));
    this.set("reply_bytes_per_token", r?.bytesPerToken, formatBytes(r?.bytesPerToken));
    this.set("reply_stall", r?.stallPerStep, formatMs(r?.stallPerStep));
    if (this.latest) this.render(this.latest);
  }

  render(stats) {
    const e = stats.engine ?? {};
    const io = e.io ?? {};
    const totals = e.totals ?? {};
    const server = stats.server ?? {};
    const available = stats.machine?.memory_available_bytes ?? null;
    const perToken = e.decode_steps ? (totals.bytes_read ?? null) / e.decode_steps : null;
    this.set("decode_steps", e.decode_steps);
    this.set("hit_rate", totals.hit_rate, formatPct(totals.hit_rate));
    this.set("bytes_per_token", e.decode_steps && totals.bytes_read != null ? perToken : null, formatBytes(perToken));
    this.set("stall_ms_per_step", e.stall_ms_per_step, formatMs(e.stall_ms_per_step));
    this.set("reads", io.reads);
    this.set("reader", io.reader);
    this.set("queue_depth", io.queue_depth);
    this.set("max_queue_depth", io.max_queue_depth);
    this.set("resident_bytes", e.resident_bytes, formatBytes(e.resident_bytes));
    this.set("expert_cache_bytes", e.expert_cache_bytes, formatBytes(e.expert_cache_bytes));
    this.set("memory_available_bytes", available, formatBytes(available));
    this.set("peak_rss_bytes", e.peak_rss_bytes, formatBytes(e.peak_rss_bytes));
    for (const k of ["requests_in_flight", "completed", "cancelled", "failed"]) this.set(k, server[k]);
    this.renderPromptCaches(e.prompt_cache ?? {});
    this.renderMemory(e.resident_bytes, e.expert_cache_bytes, available, stats.machine?.memory_source);

    const now = this.samples[this.samples.length - 1];
    const live = activeRates(this.samples, now.t - WINDOW_S * 1000);
    this.set("live_tps", live?.tps ?? (now.steps == null ? null : 0), formatTps(live?.tps ?? (now.steps == null ? null : 0)));
    this.set("live_hit_rate", live?.hitRate, formatPct(live?.hitRate));
    this.set("live_bytes_per_token", live?.bytesPerToken, formatBytes(live?.bytesPerToken));
    this.set("live_stall", live?.stallPerStep, formatMs(live?.stallPerStep));

    const memory = { cacheBytes: e.expert_cache_bytes ?? null, availableBytes: available };
    const v = verdict(live ? { ...live, ...memory } : this.reply);
    const box = this.root.querySelector("#verdict");
    const prefix = !live && this.reply && v.kind !== "idle" ? "Last reply: " : "";
    if (now.steps == null) {
      box.textContent = "This engine reports no expert-streaming counters.";
      box.dataset.kind = "none";
    } else if (box.textContent !== prefix + v.text) {
      box.textContent = prefix + v.text;
      box.dataset.kind = v.kind;
    }
    this.renderCharts();
  }

  /** The tiers that keep conversations' KV caches: memory (the pool beside the one in flight) and disk. */
  renderPromptCaches(pc) {
    const mem = pc.memory;
    this.set("pc_memory", mem?.entries, mem ? `${mem.entries} (${formatBytes(mem.bytes)} of ${formatBytes(mem.max_bytes)})` : "—");
    this.set("pc_hits", mem?.hits, mem ? `${mem.hits} / ${mem.misses}` : "—");
    this.set("pc_evicted", mem?.evicted, mem ? `${mem.evicted} (${formatBytes(mem.evicted_bytes)})` : "—");
    const disk = pc.dir ? `${pc.entries} (${formatBytes(pc.bytes)} of ${formatBytes(pc.max_bytes)})` : "off";
    this.set("pc_disk", pc.dir ? pc.entries : null, disk);
    this.set("pc_restored", pc.dir ? pc.restored : null, pc.dir ? `${pc.restored} (${pc.restored_tokens} tokens)` : "—");
  }

  renderMemory(resident, cache, available, source) {
    const parts = [resident ?? 0, cache ?? 0, available ?? 0];
    const total = parts.reduce((a, b) => a + b, 0) || 1;
    ["mem-resident", "mem-cache", "mem-free"].forEach((id, i) => {
      const seg = this.root.querySelector(`#${id}`);
      seg.style.width = `${(100 * parts[i]) / total}%`;
      seg.style.minWidth = parts[i] > 0 ? "3px" : "0"; // a small model's few MB stay visible
    });
    this.root
      .querySelector("#membar")
      .setAttribute(
        "aria-label",
        `Memory: resident weights ${formatBytes(resident)}, expert cache ${formatBytes(cache)}, ` +
          `available ${formatBytes(available)}${source ? ` (${source})` : ""}`,
      );
  }

  renderCharts() {
    const series = { tps: [], hitRate: [], bytesPerToken: [], stallPerStep: [] };
    for (let i = 1; i < this.samples.length; i++) {
      const r = rates(this.samples[i - 1], this.samples[i]);
      for (const k in series) series[k].push({ t: this.samples[i].t, v: r ? r[k] : null });
    }
    // From the first poll (at least a minute) up to the last 5 minutes: a new session is not a sliver.
    const first = this.samples[0]?.t ?? performance.now();
    const span = Math.min(HISTORY_S * 1000, Math.max(60000, performance.now() - first));
    const chart = (id, points, format) => drawChart(this.root.querySelector(id), points, format, span);
    chart("#chart-tps", series.tps, formatTps);
    chart("#chart-hit", series.hitRate, formatPct);
    chart("#chart-read", series.bytesPerToken, formatBytes);
    chart("#chart-stall", series.stallPerStep, formatMs);
  }
}
