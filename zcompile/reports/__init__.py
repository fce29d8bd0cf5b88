"""What a compiled step did: its communication and memory report, and its profiled timeline."""
