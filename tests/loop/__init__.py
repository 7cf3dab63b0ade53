"""The loop's pure parts: State and its decisions, context management, transcripts and their files, tools."""
