"""Model providers: the Anthropic API's bytes (recorded and hostile), the scripted model, the SSE reader."""
