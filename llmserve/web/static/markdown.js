// A small markdown renderer for untrusted model output. It builds DOM nodes with createElement and
// textContent only: no string of the model's ever becomes HTML, so nothing in it can run script.
// Links keep only http(s) and mailto targets; anything else stays text.

const SAFE_LINK = /^(https?:|mailto:)/i;

export function renderMarkdown(text) {
  const fragment = document.createDocumentFragment();
  const lines = text.replace(/\r\n?/g, "\n").split("\n");
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = line.match(/^\s*(`{3,}|~{3,})\s*([\w+#.-]*)/);
    if (fence) {
      const body = [];
      i += 1;
      while (i < lines.length && !lines[i].trim().startsWith(fence[1])) body.push(lines[i++]);
      i += 1; // the closing fence (absent while the answer is still streaming)
      fragment.append(codeBlock(body.join("\n"), fence[2]));
      continue;
    }
    const heading = line.match(/^(#{1,6})\s+(.*)$/);
    if (heading) {
      fragment.append(element(`h${Math.min(heading[1].length + 2, 6)}`, inline(heading[2])));
      i += 1;
      continue;
    }
    if (/^\s*([-*_])(\s*\1){2,}\s*$/.test(line)) {
      fragment.append(document.createElement("hr"));
      i += 1;
      continue;
    }
    if (/^\s*>/.test(line)) {
      const quoted = [];
      while (i < lines.length && /^\s*>/.test(lines[i])) quoted.push(lines[i++].replace(/^\s*>\s?/, ""));
      const quote = document.createElement("blockquote");
      quote.append(renderMarkdown(quoted.join("\n")));
      fragment.append(quote);
      continue;
    }
    const item = listItem(line);
    if (item) {
      const list = document.createElement(item.ordered ? "ol" : "ul");
      while (i < lines.length) {
        const next = listItem(lines[i]);
        if (!next || next.ordered !== item.ordered) break;
        list.append(element("li", inline(next.text)));
        i += 1;
      }
      fragment.append(list);
      continue;
    }
    if (!line.trim()) {
      i += 1;
      continue;
    }
    const paragraph = [];
    while (i < lines.length && lines[i].trim() && !startsBlock(lines[i])) paragraph.push(lines[i++]);
    if (!paragraph.length) paragraph.push(lines[i++]);
    fragment.append(element("p", inline(paragraph.join("\n"))));
  }
  return fragment;
}

function startsBlock(line) {
  return /^\s*(`{3,}|~{3,})/.test(line) || /^#{1,6}\s/.test(line) || /^\s*>/.test(line) || listItem(line) !== null;
}

function listItem(line) {
  const match = line.match(/^\s*(?:([-*+])|(\d+)[.)])\s+(.*)$/);
  return match ? { ordered: match[2] !== undefined, text: match[3] } : null;
}

function element(tag, children) {
  const node = document.createElement(tag);
  node.append(...children);
  return node;
}

// Inline spans: `code`, **strong**, *em* / _em_, [text](url). Everything else is text.
const INLINE = /(`+)([\s\S]*?[^`])\1(?!`)|\*\*([\s\S]+?)\*\*|\*([^*\s][^*]*?)\*|\b_([^_\s][^_]*?)_\b|\[([^\]\n]+)\]\(([^)\s]+)\)/g;

export function inline(text) {
  const nodes = [];
  let last = 0;
  for (const match of text.matchAll(INLINE)) {
    if (match.index > last) nodes.push(document.createTextNode(text.slice(last, match.index)));
    const [whole, , code, strong, em, underscored, label, href] = match;
    if (code !== undefined) nodes.push(textElement("code", code));
    else if (strong !== undefined) nodes.push(element("strong", inline(strong)));
    else if (em !== undefined || underscored !== undefined) nodes.push(element("em", inline(em ?? underscored)));
    else nodes.push(link(label, href, whole));
    last = match.index + whole.length;
  }
  if (last < text.length) nodes.push(document.createTextNode(text.slice(last)));
  return nodes;
}

function link(label, href, whole) {
  if (!SAFE_LINK.test(href)) return document.createTextNode(whole);
  const anchor = document.createElement("a");
  anchor.href = href;
  anchor.rel = "noopener noreferrer nofollow";
  anchor.target = "_blank";
  anchor.textContent = label;
  return anchor;
}

function textElement(tag, text) {
  const node = document.createElement(tag);
  node.textContent = text;
  return node;
}

// ---- code blocks ----------------------------------------------------------------------------------

const KEYWORDS = new Set((
  "and as async await break case catch class const continue def default del do elif else enum export " +
  "extends false final finally fn for from func function if impl import in interface is lambda let " +
  "match mod module mut new nil none not null or package pass pub raise return self static struct " +
  "super switch this throw true try type typeof use var void while with yield True False None"
).split(" "));

const TOKENS = /(\/\/[^\n]*|#[^\n]*|\/\*[\s\S]*?\*\/)|("(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*'|`(?:\\.|[^`\\])*`)|\b(\d+(?:\.\d+)?)\b|\b([A-Za-z_]\w*)\b/g;

export function codeBlock(code, language) {
  const figure = document.createElement("div");
  figure.className = "code";
  const bar = document.createElement("div");
  bar.className = "code-bar";
  bar.append(textElement("span", language || "text"), copyButton(() => code, "Copy code"));
  const pre = document.createElement("pre");
  const body = document.createElement("code");
  body.append(...highlight(code));
  pre.append(body);
  figure.append(bar, pre);
  return figure;
}

function highlight(code) {
  const nodes = [];
  let last = 0;
  for (const match of code.matchAll(TOKENS)) {
    const [whole, comment, string, number, word] = match;
    const kind = comment ? "com" : string ? "str" : number ? "num" : KEYWORDS.has(word) ? "kw" : null;
    if (!kind) continue;
    if (match.index > last) nodes.push(document.createTextNode(code.slice(last, match.index)));
    const span = textElement("span", whole);
    span.className = `tok-${kind}`;
    nodes.push(span);
    last = match.index + whole.length;
  }
  if (last < code.length) nodes.push(document.createTextNode(code.slice(last)));
  return nodes;
}

async function copyText(text) {
  try {
    await navigator.clipboard.writeText(text);
    return true;
  } catch {
    // No clipboard API (a page served over plain http from another host): the older way.
    const area = document.createElement("textarea");
    area.value = text;
    area.setAttribute("readonly", "");
    area.style.position = "fixed";
    area.style.opacity = "0";
    document.body.append(area);
    area.select();
    const copied = document.execCommand("copy");
    area.remove();
    return copied;
  }
}

export function copyButton(text, label = "Copy") {
  const button = document.createElement("button");
  button.type = "button";
  button.className = "copy";
  button.textContent = label;
  button.addEventListener("click", async () => {
    button.textContent = (await copyText(text())) ? "Copied" : "Copy failed";
    setTimeout(() => { button.textContent = label; }, 1200);
  });
  return button;
}
