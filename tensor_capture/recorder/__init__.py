"""The flight recorder: per-iteration summaries of every captured site in a ring, full capture
after a trigger (docs/capture.md). ``flight`` is the Recorder the saver drives; ``stats`` its
packed per-site statistics; ``ring`` the in-memory ring; ``triggers`` what starts a capture;
``out`` the summary and ring files (and rollups); ``read`` the torch-free reading of them;
``replay`` the command that reruns a triggered iteration.
"""
