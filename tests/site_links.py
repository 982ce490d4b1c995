"""The built API reference site's internal links resolve: every relative or root-relative `href` and `src` of
every HTML page names a file of the site, and a `#fragment` names an `id` of that page.

    python -m tests.site_links build/api-site      # after `mkdocs build --strict`; exit 1 with one error line

Standard library only (it runs in the small environment of requirements-docs.txt). External links
(`https:`, ...) are not fetched: CI has no network but the package index.
"""

from __future__ import annotations

import html.parser
import os
import re
import sys
import urllib.parse


class _Page(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.links: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if name in ("href", "src") and value is not None:
                self.links.append(value)
            elif name in ("id", "name") and value:
                self.ids.add(value)


def _parse(path: str) -> _Page:
    page = _Page()
    with open(path, encoding="utf-8") as f:
        page.feed(f.read())
    return page


def broken_links(site: str) -> list[str]:
    """`page: link (why)` for every internal link of the site at `site` that does not resolve."""
    site = os.path.abspath(site)
    pages = sorted(os.path.join(base, f) for base, _, files in os.walk(site) for f in files if f.endswith(".html"))
    parsed = {p: _parse(p) for p in pages}
    out = []
    for page, found in parsed.items():
        for link in found.links:
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", link) or link.startswith("//"):  # https:, mailto:, data:, ...
                continue
            parts = urllib.parse.urlsplit(link)
            path = urllib.parse.unquote(parts.path)
            if path.startswith("/"):  # from the site's root (404.html)
                target = os.path.normpath(os.path.join(site, path.lstrip("/")))
            else:
                target = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            if os.path.isdir(target):
                target = os.path.join(target, "index.html")
            name = os.path.relpath(page, site)
            if target != site and not target.startswith(site + os.sep):
                out.append(f"{name}: {link} (outside the site)")
            elif not os.path.isfile(target):
                out.append(f"{name}: {link} (no such file)")
            elif parts.fragment and target.endswith(".html"):
                ids = parsed[target].ids if target in parsed else _parse(target).ids
                if urllib.parse.unquote(parts.fragment) not in ids:
                    out.append(f"{name}: {link} (no id {parts.fragment!r} in {os.path.relpath(target, site)})")
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not os.path.isfile(os.path.join(argv[0], "index.html")):
        print(f"error: usage: python -m tests.site_links SITE_DIR (a built site with an index.html; got {argv})",
              file=sys.stderr)
        return 2
    broken = broken_links(argv[0])
    if broken:
        print(f"error: {len(broken)} broken links in the site {argv[0]}: " + "; ".join(broken[:10]), file=sys.stderr)
        return 1
    print(f"site links: every internal link of {argv[0]} resolves")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
