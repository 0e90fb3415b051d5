"""What a run leaves behind: its record, its log and progress lines, telemetry, trackers, evaluation
sheets and costs."""
