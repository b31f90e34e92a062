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
// code span | image or link | bold | strike | italic
const INLINE =
  /(`+)([^`][\s\S]*?)\1(?!`)|!?\[([^\]\n]*)\]\(\s*([^)\s]+)\s*\)|\*\*(?=\S)([\s\S]*?\S)\*\*|~~(?=\S)([\s\S]*?\S)~~|\*(?=[^\s*])([^*\n]*?[^\s*])\*/;
const SAFE_URL = /^(https?:|mailto:)/i;

function el(tag, className) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  return node;
}

/** Append the inline content of `text` (code spans, links, emphasis) to `parent`. */
export function appendInline(parent, text) {
  while (text) {
    const m = INLINE.exec(text);
    if (!m) {
      parent.append(document.createTextNode(text));
      return;
    }
    if (m.index) parent.append(document.createTextNode(text.slice(0, m.index)));
    if (m[1]) {
      const code = el("code");
      code.textContent = m[2].length > 2 && m[2].startsWith(" ") && m[2].endsWith(" ") ? m[2].slice(1, -1) : m[2];
      parent.append(code);
    } else if (m[4] !== undefined) {
      if (SAFE_URL.test(m[4])) {
        const a = el("a");
        a.href = m[4];
        a.rel = "noopener noreferrer";
        a.target = "_blank";
        appendInline(a, m[3] || m[4]);
        parent.append(a);
      } else {
        parent.append(document.createTextNode(m[0]));
      }
    } else {
      const node = el(m[5] !== undefined ? "strong" : m[6] !== undefined ? "del" : "em");
      appendInline(node, m[5] ?? m[6] ?? m[7]);
      parent.append(node);
    }
    text = text.slice(m.index + m[0].length);
  }
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

/** A DocumentFragment rendering Markdown `text` (a reply still streaming renders as far as it goes). */
export function renderMarkdown(text) {
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
    if (QUOTE.test(line)) {
      const body = [];
      while (i < lines.length && QUOTE.test(lines[i])) body.push(QUOTE.exec(lines[i++])[1]);
      const quote = el("blockquote");
      quote.append(renderMarkdown(body.join("\n")));
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
    const para = [];
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
