"""MCP servers as tools: a real server subprocess, its hostile answers, elicitation, credentials."""
