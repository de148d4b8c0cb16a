"""A training engine and its optimizer-update helper that know each other (the helper's learning
rate arrives through the engine's call, the engine builds the helper): a cycle the checker's
value analysis must cut without its answer depending on which question came first."""
