"""OpenAI's API: chat, completions' wire shapes and the Responses API."""
