// A small markdown renderer for model replies: fenced code (highlighted), inline code, headings, bold, italic,
// strikethrough, lists, block quotes, rules, links and paragraphs. Every piece of text is HTML-escaped before any
// markup is added, and links keep only http(s) and mailto targets, so a reply can never inject markup or script.
"use strict";

(function () {
  const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
  const escapeHtml = (text) => text.replace(/[&<>"']/g, (c) => ESCAPES[c]);

  // -- code highlighting: one pass of a token regex, each piece escaped and wrapped in a class -------------------
  const KEYWORDS = new Set(("and as assert async await break case catch class const continue def default del do " +
    "elif else enum except export extends false False finally fn for from func function go if impl import in " +
    "interface is lambda let loop match mod module mut new nil None not null or package pass pub raise return " +
    "self static struct super switch this throw true True try type typeof use var void while with yield").split(" "));
  const HASH_COMMENTS = new Set(["python", "py", "sh", "bash", "shell", "zsh", "ruby", "rb", "yaml", "yml", "toml",
    "r", "perl", "makefile", "make", "dockerfile", "ini", "conf"]);
  const TOKEN = {
    hash: /(#[^\n]*)|("""[\s\S]*?(?:"""|$)|'''[\s\S]*?(?:'''|$)|"(?:\\.|[^"\\\n])*"?|'(?:\\.|[^'\\\n])*'?)|(\b\d[\d_]*(?:\.\d+)?(?:e[+-]?\d+)?\b|\b0x[\da-f]+\b)|([A-Za-z_$][\w$]*)/gi,
    slash: /(\/\/[^\n]*|\/\*[\s\S]*?(?:\*\/|$))|("(?:\\.|[^"\\\n])*"?|'(?:\\.|[^'\\\n])*'?|`(?:\\.|[^`\\])*`?)|(\b\d[\d_]*(?:\.\d+)?(?:e[+-]?\d+)?\b|\b0x[\da-f]+\b)|([A-Za-z_$][\w$]*)/gi,
  };

  function highlight(code, lang) {
    const pattern = TOKEN[HASH_COMMENTS.has((lang || "").toLowerCase()) ? "hash" : "slash"];
    pattern.lastIndex = 0;
    let out = "", last = 0, match;
    while ((match = pattern.exec(code)) !== null) {
      if (match[0] === "") { pattern.lastIndex++; continue; }
      out += escapeHtml(code.slice(last, match.index));
      const text = escapeHtml(match[0]);
      if (match[1]) out += `<span class="tok-com">${text}</span>`;
      else if (match[2]) out += `<span class="tok-str">${text}</span>`;
      else if (match[3]) out += `<span class="tok-num">${text}</span>`;
      else if (KEYWORDS.has(match[4])) out += `<span class="tok-kw">${text}</span>`;
      else out += text;
      last = pattern.lastIndex;
    }
    return out + escapeHtml(code.slice(last));
  }

  // -- inline: code spans set aside first, then links and emphasis on the escaped text -----------------------------
  function inline(text) {
    const spans = [];
    const hold = (html) => `\u0000${spans.push(html) - 1}\u0000`;
    let html = escapeHtml(text.replace(/\u0000/g, ""));
    html = html.replace(/(`+)([\s\S]*?[^`])\1(?!`)/g, (_, ticks, code) => hold(`<code>${code.trim()}</code>`));
    html = html.replace(/\[([^\]\n]+)\]\(([^)\s]+)\)/g, (whole, label, url) => {
      if (!/^(https?:|mailto:)/i.test(url)) return whole;   // javascript: and the like stay plain text
      return hold(`<a href="${url}" target="_blank" rel="noopener noreferrer">${label}</a>`);
    });
    html = html.replace(/(^|[\s(])(https?:\/\/(?:[^\s<&]|&amp;)*[^\s<&.,;:!?)])/g,
      (_, pre, url) => pre + hold(`<a href="${url}" target="_blank" rel="noopener noreferrer">${url}</a>`));
    html = html
      .replace(/\*\*(?=\S)([\s\S]*?\S)\*\*/g, "<strong>$1</strong>")
      .replace(/(^|[^\w])__(?=\S)([\s\S]*?\S)__(?!\w)/g, "$1<strong>$2</strong>")
      .replace(/~~(?=\S)([\s\S]*?\S)~~/g, "<del>$1</del>")
      .replace(/(^|[^*\w])\*(?=[^\s*])([^*\n]*?[^\s*])\*(?!\*)/g, "$1<em>$2</em>")
      .replace(/(^|[^\w])_(?=[^\s_])([^_\n]*?[^\s_])_(?!\w)/g, "$1<em>$2</em>");
    return html.replace(/\u0000(\d+)\u0000/g, (_, i) => spans[Number(i)]);
  }

  // -- blocks ------------------------------------------------------------------------------------------------------
  const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)/;
  const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
  const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
  const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
  const QUOTE = /^ {0,3}> ?(.*)$/;

  function startsBlock(line) {
    return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || ITEM.test(line) || QUOTE.test(line);
  }

  function render(markdown) {
    const lines = String(markdown || "").replace(/\r\n?/g, "\n").split("\n");
    const out = [];
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      let m;
      if (!line.trim()) { i++; continue; }
      if ((m = FENCE.exec(line))) {
        const fence = m[1], lang = m[2], body = [];
        const close = new RegExp(`^ {0,3}${fence[0] === "`" ? "`" : "~"}{${fence.length},}\\s*$`);
        for (i++; i < lines.length && !close.test(lines[i]); i++) body.push(lines[i]);
        i++;   // the closing fence (or the end: a reply still streaming)
        const cls = lang ? ` class="lang-${escapeHtml(lang)}"` : "";
        out.push(`<pre><code${cls}>${highlight(body.join("\n"), lang)}</code></pre>`);
      } else if ((m = HEADING.exec(line))) {
        out.push(`<h${m[1].length}>${inline(m[2])}</h${m[1].length}>`);
        i++;
      } else if (RULE.test(line)) {
        out.push("<hr>");
        i++;
      } else if (QUOTE.test(line)) {
        const body = [];
        for (; i < lines.length && (m = QUOTE.exec(lines[i])); i++) body.push(m[1]);
        out.push(`<blockquote>${render(body.join("\n"))}</blockquote>`);
      } else if ((m = ITEM.exec(line))) {
        i = list(lines, i, out);
      } else {
        const body = [];
        for (; i < lines.length && lines[i].trim() && !startsBlock(lines[i]); i++) body.push(lines[i].trim());
        out.push(`<p>${body.map(inline).join("<br>")}</p>`);
      }
    }
    return out.join("\n");
  }

  // One list from lines[start]; an item's more-indented lines (nested lists, continued text) render inside it.
  function list(lines, start, out) {
    const first = ITEM.exec(lines[start]);
    const indent = first[1].length, ordered = /\d/.test(first[2]);
    const items = [];
    let i = start;
    while (i < lines.length) {
      const m = ITEM.exec(lines[i]);
      if (!m || m[1].length !== indent || /\d/.test(m[2]) !== ordered) break;
      const body = [m[3]];
      for (i++; i < lines.length; i++) {
        const next = lines[i];
        if (!next.trim()) {
          if (i + 1 < lines.length && lines[i + 1].search(/\S/) > indent) { body.push(""); continue; }
          break;
        }
        if (next.search(/\S/) <= indent) break;
        body.push(next.slice(Math.min(next.search(/\S/), indent + 2 + m[2].length - 1)));
      }
      const inner = body.length === 1 ? inline(body[0]) : render(body.join("\n"));
      items.push(`<li>${inner}</li>`);
      while (i < lines.length && !lines[i].trim()) {
        const after = lines[i + 1];
        if (after !== undefined && ITEM.test(after) && ITEM.exec(after)[1].length === indent) i++;
        else break;
      }
    }
    const start1 = ordered ? parseInt(first[2], 10) : 1;
    const tag = ordered ? "ol" : "ul";
    out.push(`<${tag}${ordered && start1 !== 1 ? ` start="${start1}"` : ""}>${items.join("")}</${tag}>`);
    return i;
  }

  window.cvllmMarkdown = { render, highlight, escapeHtml };
})();
