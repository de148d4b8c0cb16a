"""Runnable numerical-issue cases; each has ``run()`` returning what the matching tool found."""
