"""One FastAPI router per API. Each handler declares its typed body and response; the app
(server/api.py) serves every router's routes, and /openapi.json is built from them.

    openai.py   /v1/completions, /v1/chat/completions, /v1/embeddings, /v1/models, /tokenize,
                /detokenize, /tokenizer_info
    responses.py  /v1/responses, /v1/responses/{id} (OpenAI's Responses API)
    anthropic.py  /v1/messages, /v1/messages/count_tokens (Anthropic's Messages API)
    ollama.py   /api/chat, /api/generate, /api/embed, /api/embeddings, /api/tags, /api/ps,
                /api/show, /api/version
    admin.py    /health, /version, /metrics, /v1/usage, /v1/stats, and the control routes
                /reset_prefix_cache and /abort_request (only with keys; the admin key's)
    pages.py    /dashboard, /docs, /static/{name}, /openapi.json
"""
