"""The communication profiler: the file (schema), each rank's recorder of its engine's events
(recorder), and ``hpdl profile`` reading the file (analysis, findings, report, timeline, html,
cli). The recording across ranks runs through hpdl.torch (hpdl/torch/profiler/). See
docs/profile.md."""
