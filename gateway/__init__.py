"""stagemesh gateway: the OpenAI HTTP API in front of the stage mesh.

``gateway.app.create_app(GatewayConfig(...), mesh=..., tokenizer=...,
eos_token_ids=...)`` builds the FastAPI app; the other modules each do one job
(see their docstrings).
"""
