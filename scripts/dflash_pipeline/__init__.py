"""DFlash drafter pipeline: ingest -> tokenize/audit -> generate -> extract -> train -> export -> evaluate."""

__version__ = "0.1.0"
