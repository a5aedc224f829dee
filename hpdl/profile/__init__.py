"""The communication profiler: record every rank's collectives and steps (recorder, clock,
session, schema) and read the file (analysis, findings, report, timeline, html, cli).
See docs/profile.md."""
