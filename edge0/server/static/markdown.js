// Markdown to DOM nodes for model replies. Every piece of model text becomes a text node
// (createTextNode / textContent), never markup: a reply holding <script> or <img onerror> shows
// as those characters. Covers what chat models write: fenced code, inline code, headings,
// lists, quotes, rules, bold, italic, strike-through and http(s) links. Images are shown as links:
// the page loads nothing from other hosts.

const FENCE = /^\s*(`{3,}|~{3,})\s*([\w+#.-]*)\s*$/;
const HEADING = /^(#{1,6})\s+(.*)$/;
const RULE = /^\s*([-*_])(\s*\1){2,}\s*$/;
const QUOTE = /^\s*>\s?(.*)$/;
const BULLET = /^\s*[-*+]\s+(.*)$/;
const NUMBERED = /^\s*(\d{1,9})[.)]\s+(.*)$/;
const SAFE_URL = /^(https?:|mailto:)/i;
const SPACE = /\s/;
// \s without a regular expression call for ASCII (the tables below test every character)
const isSpace = (c) =>
  c !== undefined && (c === " " || c === "\n" || c === "\t" || ((c > "~" || c < " ") && SPACE.test(c)));

function el(tag, className) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  return node;
}

/** For every index of `text`, the first index at or after it where `match(i)` holds (text.length if
 * none): one scan from the end, so that each closer below is found in O(1). */
function nextWhere(text, match) {
  const next = new Int32Array(text.length + 2).fill(text.length);
  for (let i = text.length - 1; i >= 0; i--) next[i] = match(i) ? i : next[i + 1];
  return next;
}

/** The inline syntax of one text, in one pass: code spans, links and images, bold, strike-through
 * and italic, each closed by the first closer after its opener (as the lazy regular expression
 * this replaces did). Every closer is looked up in a table built once, so the work is linear in
 * the text's length; a regular expression tried at every opener rescanned the rest of the text
 * each time (64 KB of `[a](` took 3.8 s to render). */
class Inline {
  constructor(text) {
    const t = (this.text = text);
    const nonSpace = (i) => i >= 0 && i < t.length && !isSpace(t[i]);
    // runs of backticks: the first index of each run, its length, and the next run of that length
    this.runLength = new Int32Array(t.length);
    this.nextRun = new Int32Array(t.length).fill(-1);
    const lastOfLength = new Map();
    for (let i = t.length - 1; i >= 0; i--) {
      if (t[i] !== "`" || t[i - 1] === "`") continue;
      let n = 1;
      while (t[i + n] === "`") n++;
      this.runLength[i] = n;
      this.nextRun[i] = lastOfLength.get(n) ?? -1;
      lastOfLength.set(n, i);
    }
    this.closeBracket = nextWhere(t, (i) => t[i] === "]" || t[i] === "\n");
    this.urlEnd = nextWhere(t, (i) => t[i] === ")" || isSpace(t[i]));
    this.nonSpaceAt = nextWhere(t, (i) => !isSpace(t[i]));
    this.newline = nextWhere(t, (i) => t[i] === "\n");
    this.star = nextWhere(t, (i) => t[i] === "*");
    // a closing ** or ~~: the pair, with a non-space character before it
    this.bold = nextWhere(t, (i) => t[i] === "*" && t[i + 1] === "*" && nonSpace(i - 1));
    this.strike = nextWhere(t, (i) => t[i] === "~" && t[i + 1] === "~" && nonSpace(i - 1));
  }

  /** The element that starts at `i` (before `end`): [kind, content start, content end, next index,
   * url], or null. */
  at(i, end) {
    const t = this.text;
    const c = t[i];
    if (c === "`" && this.runLength[i]) {
      const n = this.runLength[i];
      const close = this.nextRun[i];
      if (close > i + n && close + n <= end) return ["code", i + n, close, close + n];
      return null;
    }
    const bracket = c === "[" ? i : c === "!" && t[i + 1] === "[" ? i + 1 : -1;
    if (bracket >= 0) {
      const close = this.closeBracket[bracket + 1];
      if (close < end && t[close] === "]" && t[close + 1] === "(") {
        const from = this.nonSpaceAt[close + 2];
        const to = this.urlEnd[from];
        const after = this.nonSpaceAt[to];
        if (to > from && after < end && t[after] === ")")
          return ["link", bracket + 1, close, after + 1, t.slice(from, to)];
      }
      return null;
    }
    const next = t[i + 1];
    if ((c === "*" && next === "*") || (c === "~" && next === "~")) {
      if (i + 2 >= end || isSpace(t[i + 2])) return null;
      const close = (c === "*" ? this.bold : this.strike)[i + 3];
      if (close + 2 <= end) return [c === "*" ? "strong" : "del", i + 2, close, close + 2];
      if (c === "~") return null;
    }
    if (c === "*" && next !== undefined && next !== "*" && !isSpace(next)) {
      const close = this.star[i + 1];
      if (close < end && close < this.newline[i] && !isSpace(t[close - 1])) return ["em", i + 1, close, close + 1];
    }
    return null;
  }

  /** Append the inline content of text[start, end) to `parent`. */
  append(parent, start, end) {
    const t = this.text;
    let plain = start;
    for (let i = start; i < end; ) {
      const found = this.at(i, end);
      if (!found) {
        i++;
        continue;
      }
      const [kind, from, to, next, url] = found;
      if (i > plain) parent.append(document.createTextNode(t.slice(plain, i)));
      if (kind === "code") {
        const s = t.slice(from, to);
        const code = el("code");
        code.textContent = s.length > 2 && s.startsWith(" ") && s.endsWith(" ") ? s.slice(1, -1) : s;
        parent.append(code);
      } else if (kind === "link" && !SAFE_URL.test(url)) {
        parent.append(document.createTextNode(t.slice(i, next)));
      } else if (kind === "link") {
        const a = el("a");
        a.href = url;
        a.rel = "noopener noreferrer";
        a.target = "_blank";
        if (to > from) this.append(a, from, to);
        else a.append(document.createTextNode(url));
        parent.append(a);
      } else {
        const node = el(kind);
        this.append(node, from, to);
        parent.append(node);
      }
      i = plain = next;
    }
    if (end > plain) parent.append(document.createTextNode(t.slice(plain, end)));
  }
}

/** Append the inline content of `text` (code spans, links, emphasis) to `parent`. */
export function appendInline(parent, text) {
  new Inline(text).append(parent, 0, text.length);
}

function appendLines(parent, lines) {
  lines.forEach((line, i) => {
    if (i) parent.append(el("br"));
    appendInline(parent, line);
  });
}

function codeBlock(lang, lines) {
  const wrap = el("div", "code");
  const bar = el("div", "code-bar");
  const label = el("span");
  label.textContent = lang || "code";
  const copy = el("button", "copy");
  copy.type = "button";
  copy.textContent = "Copy";
  copy.setAttribute("aria-label", `Copy ${lang || "code"} block`);
  const pre = el("pre");
  const code = el("code");
  if (lang) code.dataset.lang = lang;
  code.textContent = lines.join("\n");
  copy.addEventListener("click", () => {
    navigator.clipboard?.writeText(code.textContent).then(
      () => (copy.textContent = "Copied"),
      () => (copy.textContent = "Copy failed"),
    );
  });
  bar.append(label, copy);
  pre.append(code);
  wrap.append(bar, pre);
  return wrap;
}

// Quotes nest at most this deep; deeper `>` are text (each level renders its lines again).
const QUOTE_DEPTH = 8;

/** A DocumentFragment rendering Markdown `text` (a reply still streaming renders as far as it goes). */
export function renderMarkdown(text, depth = 0) {
  const out = document.createDocumentFragment();
  const lines = String(text).replace(/\r\n?/g, "\n").split("\n");
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = FENCE.exec(line);
    if (fence) {
      const body = [];
      i++;
      while (i < lines.length && !lines[i].trim().startsWith(fence[1])) body.push(lines[i++]);
      i++; // the closing fence (or past the end while streaming)
      out.append(codeBlock(fence[2], body));
      continue;
    }
    if (!line.trim()) {
      i++;
      continue;
    }
    const heading = HEADING.exec(line);
    if (heading) {
      const h = el(`h${Math.min(6, heading[1].length + 2)}`);
      appendInline(h, heading[2]);
      out.append(h);
      i++;
      continue;
    }
    if (RULE.test(line)) {
      out.append(el("hr"));
      i++;
      continue;
    }
    if (QUOTE.test(line) && depth < QUOTE_DEPTH) {
      const body = [];
      while (i < lines.length && QUOTE.test(lines[i])) body.push(QUOTE.exec(lines[i++])[1]);
      const quote = el("blockquote");
      quote.append(renderMarkdown(body.join("\n"), depth + 1));
      out.append(quote);
      continue;
    }
    const ordered = NUMBERED.test(line);
    if (ordered || BULLET.test(line)) {
      const pattern = ordered ? NUMBERED : BULLET;
      const list = el(ordered ? "ol" : "ul");
      if (ordered && NUMBERED.exec(line)[1] !== "1") list.start = Number(NUMBERED.exec(line)[1]);
      while (i < lines.length && pattern.test(lines[i])) {
        const m = pattern.exec(lines[i++]);
        const item = el("li");
        const body = [ordered ? m[2] : m[1]];
        // continuation lines: indented, not a new item or block
        while (i < lines.length && /^\s{2,}\S/.test(lines[i]) && !pattern.test(lines[i]) && !FENCE.test(lines[i]))
          body.push(lines[i++].trim());
        appendLines(item, body);
        list.append(item);
      }
      out.append(list);
      continue;
    }
    const para = [lines[i++]]; // no other block starts here
    while (
      i < lines.length &&
      lines[i].trim() &&
      !FENCE.test(lines[i]) &&
      !HEADING.test(lines[i]) &&
      !QUOTE.test(lines[i]) &&
      !BULLET.test(lines[i]) &&
      !NUMBERED.test(lines[i]) &&
      !RULE.test(lines[i])
    )
      para.push(lines[i++]);
    const p = el("p");
    appendLines(p, para);
    out.append(p);
  }
  return out;
}

/** A reply rendered into `node` as it streams: the blocks that are finished (up to the last blank
 * line outside a code fence, where the renderer starts afresh) are rendered once and kept, and
 * only the rest is rendered again on each update, so a long reply costs its length once, not once
 * per animation frame. */
export class MarkdownView {
  constructor(node) {
    this.node = node;
    this.reset("");
  }

  reset(text) {
    this.node.replaceChildren();
    this.text = text;
    this.done = 0; // text[0, done) is rendered in the finished blocks
    this.scanned = 0; // the complete lines of text[0, scanned) were looked at for block ends
    this.fence = null; // the marker of the code fence open at `scanned`, if any
    this.tail = []; // the nodes of text[done, ...)
  }

  update(text) {
    if (!text.startsWith(this.text.slice(0, this.done))) this.reset(text);
    this.text = text;
    let end = this.done;
    for (let nl = text.indexOf("\n", this.scanned); nl >= 0; nl = text.indexOf("\n", this.scanned)) {
      const line = text.slice(this.scanned, nl);
      if (this.fence) {
        if (line.trim().startsWith(this.fence)) this.fence = null;
      } else if (FENCE.test(line)) {
        this.fence = FENCE.exec(line)[1];
      } else if (!line.trim()) {
        end = this.scanned; // a blank line outside a fence: every block before it is finished
      }
      this.scanned = nl + 1;
    }
    for (const n of this.tail) n.remove();
    if (end > this.done) {
      this.node.append(renderMarkdown(text.slice(this.done, end)));
      this.done = end;
    }
    const rest = renderMarkdown(text.slice(this.done));
    this.tail = [...rest.childNodes];
    this.node.append(rest);
  }
}
