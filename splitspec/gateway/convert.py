"""OpenAI requests → `GenerateRequest`; the target's answers → OpenAI's fields.

The chat template is the target's: a chat request goes over the public API as
`ChatMessages`, rendered by the target's tokenizer (as vLLM renders it in its server),
so the gateway holds no tokenizer and cannot disagree with the target about it.
"""

from __future__ import annotations

import json

from splitspec.gateway.protocol import (
    ChatCompletionRequest,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    CompletionRequest,
    PromptTokensDetails,
    SamplingRequest,
    SpeculationUsage,
    TopLogprob,
    Usage,
    message_text,
)
from splitspec.v1 import generation_pb2 as pb

OPENAI_DEFAULT_TEMPERATURE = 1.0
FINISH_REASONS = {
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_MODEL_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",  # as vLLM: aborted on the target (Abort RPC, shutdown)
}


def _sampling(req: SamplingRequest, max_tokens: int | None, request: pb.GenerateRequest) -> None:
    temperature = OPENAI_DEFAULT_TEMPERATURE if req.temperature is None else req.temperature
    request.sampling.temperature = temperature
    if req.top_p is not None:
        request.sampling.top_p = req.top_p
    if req.top_k is not None:
        request.sampling.top_k = req.top_k
    if req.seed is not None:
        request.sampling.seed = req.seed
    if max_tokens is not None:
        request.stop.max_tokens = max_tokens
    request.stop.stop.extend(req.stop_strings())
    request.stop.stop_token_ids.extend(req.stop_token_ids or ())
    request.stop.ignore_eos = req.ignore_eos
    _shaping(req, request)
    if req.n is not None:
        request.n = req.n
    if req.speculation is not None:
        request.speculation.disable = req.speculation.disable
        request.speculation.num_speculative_tokens = req.speculation.num_speculative_tokens
    if req.cache_salt is not None:
        request.cache_salt = req.cache_salt
    _structured_output(req, request)


def _structured_output(req: SamplingRequest, request: pb.GenerateRequest) -> None:
    """response_format (OpenAI) or structured_outputs (vLLM) → StructuredOutput; `validation` saw
    that one constraint at most is set, and that it is complete."""
    fmt, so = req.response_format, req.structured_outputs
    target = request.structured_output
    if fmt is not None and fmt.type == "json_object":
        target.json_object = True
    elif fmt is not None and fmt.type == "json_schema":
        target.json_schema = json.dumps(fmt.json_schema.json_schema, ensure_ascii=False)
    elif so is not None and so.json_ is not None:
        target.json_schema = so.json_ if isinstance(so.json_, str) else json.dumps(so.json_, ensure_ascii=False)
    elif so is not None and so.regex is not None:
        target.regex = so.regex
    elif so is not None and so.choice is not None:
        target.choice.choices.extend(so.choice)
    elif so is not None and so.json_object:
        target.json_object = True
    if so is not None:  # its options apply to a response_format too
        target.disable_any_whitespace = so.disable_any_whitespace


def _shaping(req: SamplingRequest, request: pb.GenerateRequest) -> None:
    """Penalties, min_p, logit_bias (its keys checked by validation), banned ids and min_tokens."""
    sampling = request.sampling
    for name in ("presence_penalty", "frequency_penalty", "min_p", "repetition_penalty"):
        if (value := getattr(req, name)) is not None:
            setattr(sampling, name, value)
    if req.logit_bias:
        sampling.logit_bias.update({int(token): bias for token, bias in req.logit_bias.items()})
    sampling.banned_token_ids.extend(req.banned_token_ids or ())
    if req.min_tokens is not None:
        request.stop.min_tokens = req.min_tokens


def completion_request(req: CompletionRequest, request_id: str) -> pb.GenerateRequest:
    request = pb.GenerateRequest(request_id=request_id)
    prompt = req.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        request.text = prompt
        request.parse_special_tokens = req.parse_special_tokens
    else:
        request.token_ids.ids.extend(prompt)  # empty: the target names the field
    _sampling(req, req.max_tokens, request)
    if req.logprobs is not None:
        request.logprobs.completion, request.logprobs.top = True, req.logprobs
    if req.echo and (req.logprobs is not None or not isinstance(prompt, str)):
        # the prompt's tokens: their logprobs, or the text of a prompt sent as token ids
        request.logprobs.prompt, request.logprobs.prompt_top = True, req.logprobs or 0
    return request


def chat_request(req: ChatCompletionRequest, request_id: str) -> pb.GenerateRequest:
    request = pb.GenerateRequest(request_id=request_id)
    for message in req.messages:
        request.chat.messages.add(role=message.role, content=message_text(message))
    request.chat.add_generation_prompt = req.add_generation_prompt
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    _sampling(req, max_tokens, request)
    if req.logprobs:
        request.logprobs.completion, request.logprobs.top = True, req.top_logprobs or 0
    return request


def usage(*per_choice: pb.Usage) -> Usage:
    """One request's usage: the prompt once, the completions of all its choices summed."""
    prompt = per_choice[0].prompt_tokens if per_choice else 0
    completion = sum(u.completion_tokens for u in per_choice)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=per_choice[0].cached_tokens if per_choice
                                                           else 0),
                 speculation=SpeculationUsage(num_drafts=sum(u.num_drafts for u in per_choice),
                                              draft_tokens=sum(u.draft_tokens for u in per_choice),
                                              accepted_tokens=sum(u.accepted_tokens for u in per_choice)))


# ---------------------------------------------------------------- logprobs


def completion_logprobs(entries: list[pb.PositionLogprobs], offset: int = 0) -> CompletionLogprobs:
    """The legacy shape; `offset`: the text offset of the first token. Each position's
    top_logprobs holds its alternatives and the chosen token (as vLLM's)."""
    out = CompletionLogprobs()
    for entry in entries:
        chosen = entry.chosen
        has_value = chosen.HasField("logprob")
        out.tokens.append(chosen.token)
        out.token_logprobs.append(chosen.logprob if has_value else None)
        top = {t.token: t.logprob for t in entry.top}
        if has_value:
            top.setdefault(chosen.token, chosen.logprob)
        out.top_logprobs.append(top if has_value else None)
        out.text_offset.append(offset)
        offset += len(chosen.token)
    return out


def chat_logprobs(entries: list[pb.PositionLogprobs]) -> ChatLogprobs:
    return ChatLogprobs(content=[
        ChatTokenLogprob(token=e.chosen.token, logprob=e.chosen.logprob, bytes=list(e.chosen.token.encode()),
                         top_logprobs=[TopLogprob(token=t.token, logprob=t.logprob, bytes=list(t.token.encode()))
                                       for t in e.top])
        for e in entries])


def finish_reason(complete: pb.Complete) -> str:
    return FINISH_REASONS.get(complete.finish_reason, "stop")
