"""The ``kwker-cache`` command-line tool: inspect, prewarm and clear Kwker's kernel cache."""
