"""Model providers behind `queryloop.runtime.loop.model.ModelProvider`, one module each: `scripted`
(offline, deterministic: every test and the demo) and `anthropic_model` (the real Messages API through
the `anthropic` SDK); and `local_api`, a Messages-API-compatible server on loopback for end-to-end tests,
which plays a `wire_script`.
Imports `queryloop.runtime.loop` and `queryloop.runtime.errors`.
"""
