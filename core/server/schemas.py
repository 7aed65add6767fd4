"""The request bodies of the OpenAI-compatible endpoints, as clients send them.

Fields the server does not act on (temperature, top_p, penalties, user, ...) are accepted and left alone, as
other OpenAI-compatible servers do; a known field of the wrong type or out of range is a 422 naming it. Any
`FusionConfig` field (tau_delta, num_branches, ...) may be sent too (e.g. `extra_body` of the openai client).
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    seed: int | None = Field(default=None, ge=0)

    def extras(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class CompletionRequest(_Common):
    prompt: str | list[str] = Field(min_length=1)
    max_tokens: int | None = Field(default=16, ge=1)
    echo: Literal[False] = False
    logprobs: None = None


class JsonSchemaFormat(BaseModel):
    name: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(_Common):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: ResponseFormat | None = None

    def json_schema(self) -> dict[str, Any] | None:
        """The schema the reply must match, from `response_format`."""
        if self.response_format is None or self.response_format.type == "text":
            return None
        if self.response_format.type == "json_object":
            return {"type": "object"}
        if self.response_format.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema with a schema")
        return self.response_format.json_schema.schema_
