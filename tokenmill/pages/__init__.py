"""The pages a server shows, /dashboard and /docs, and their scripts: static files (package
data) that hold no data of their own (their scripts fetch it with the key they ask for). The
server of one model and the host of many both send them from here."""

from __future__ import annotations

import importlib.resources

# The files here, and their types.
FILES = {
    "dashboard.html": "text/html; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "docs.html": "text/html; charset=utf-8",
    "docs.js": "text/javascript; charset=utf-8",
}
SCRIPTS = ("dashboard.js", "docs.js")  # what /static/{name} serves
PAGES = {"/dashboard": "dashboard.html", "/docs": "docs.html"}


def read(name: str) -> tuple[bytes, str]:
    """A file's bytes and media type; KeyError for a name not in FILES."""
    media_type = FILES[name]
    return (importlib.resources.files(__package__) / name).read_bytes(), media_type
