"""Knowledge base of the profiler: README notes per topic and runnable case scripts
(``training_profiler.skills.numerical_issues.case_*``), each detected by one of the tools."""
