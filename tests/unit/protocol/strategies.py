"""Hypothesis strategies for valid protocol messages and arbitrary JSON."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from meshd.protocol import (
    MAX_KEEP_ALIVE_S,
    MODEL_STATES,
    Cancel,
    CancelReply,
    ChatMessage,
    Detokenize,
    DetokenizeReply,
    Done,
    ErrorCode,
    ErrorMessage,
    FinishReason,
    Generate,
    Health,
    HealthReply,
    HealthStatus,
    Hello,
    Load,
    LoadReply,
    ModelInfo,
    Models,
    ModelsReply,
    ProposerStats,
    SamplingParams,
    SpeculationStats,
    SpeculativeOverrides,
    Stats,
    StatsReply,
    Token,
    Tokenize,
    TokenizeReply,
    ToolCall,
    ToolFunction,
    Unload,
    UnloadReply,
    Usage,
    Welcome,
)
from meshd.protocol.chat_messages import TOOL_NAME_PATTERN
from meshd.protocol.messages import MAX_SEED
from meshd.protocol.validators import MODEL_NAME_PATTERN

# codec="utf-8" keeps surrogates out: they cannot travel as UTF-8.
chars = st.characters(codec="utf-8")
texts = st.text(chars, max_size=12)
names = st.text(chars, min_size=1, max_size=12)
ids = st.text(chars, min_size=1, max_size=24)
counts = st.integers(0, 2**40)
token_lists = st.lists(st.integers(0, 2**31), max_size=6).map(tuple)
non_negative = st.floats(0, 1e12, allow_nan=False, allow_infinity=False)
counter_values = non_negative | counts

sampling = st.builds(
    SamplingParams,
    temperature=non_negative,
    top_k=counts,
    top_p=st.floats(0, 1, exclude_min=True),
    seed=st.none() | st.integers(0, MAX_SEED),
)
speculative = st.builds(
    SpeculativeOverrides,
    proposer=st.none() | names,
    draft_max=st.none() | st.integers(1, 1024),
)
tool_names = st.from_regex(TOOL_NAME_PATTERN, fullmatch=True)
tool_calls = st.builds(ToolCall, id=ids, name=tool_names, arguments=texts)
chat_messages = st.lists(st.builds(
    ChatMessage, role=names, content=texts,
    tool_calls=st.none() | st.lists(tool_calls, max_size=2).map(tuple),
    tool_call_id=st.none() | ids), min_size=1, max_size=3)
tools = st.lists(st.builds(ToolFunction, name=tool_names, description=texts,
                           parameters=st.none() | st.just({"type": "object"})),
                 min_size=1, max_size=3, unique_by=lambda f: f.name).map(tuple)
model_names = st.from_regex(MODEL_NAME_PATTERN, fullmatch=True)
keep_alives = st.none() | st.just(-1) | st.integers(0, MAX_KEEP_ALIVE_S) | st.floats(
    0, MAX_KEEP_ALIVE_S)
# A model's state decides whether it is loaded; a daemon that names no state may say either.
loaded_states = st.tuples(st.booleans(), st.none()) | st.sampled_from(MODEL_STATES).map(
    lambda state: (state == "loaded", state))
model_info = st.builds(
    lambda loaded_state, **kw: ModelInfo(loaded=loaded_state[0], state=loaded_state[1], **kw),
    name=names,
    architecture=st.none() | names,
    n_ctx=counts,
    n_vocab=counts,
    n_params=st.none() | counts,
    size_bytes=st.none() | counts,
    has_mtp=st.booleans(),
    has_chat_template=st.booleans(),
    gpu_layers=st.integers(min_value=0, max_value=200),
    loaded_state=loaded_states,
    default=st.booleans(),
    proposers=st.lists(names, max_size=3).map(tuple),
    keep_alive_s=keep_alives,
)
speculation_stats = st.builds(
    SpeculationStats,
    proposer=st.none() | names,
    emitted=counts,
    target_forwards=counts,
    verify_calls=counts,
    drafted=counts,
    accepted=counts,
    accepted_per_position=st.lists(counts, max_size=4),
    rollbacks_in_place=counts,
    checkpoints=counts,
    checkpoint_bytes=counts,
    restores=counts,
    wall_ms=non_negative,
    prefill_ms=non_negative,
    decode_ms=non_negative,
    verify_ms=non_negative,
    refusals=st.dictionaries(texts, counts, max_size=3),
    extra=st.dictionaries(texts, counter_values, max_size=3),
)
proposer_stats = st.builds(
    ProposerStats,
    requests=counts,
    drafted=counts,
    accepted=counts,
    accepted_per_position=token_lists,
)


def _generate() -> st.SearchStrategy[Generate]:
    common: dict[str, Any] = {
        "id": ids,
        "max_tokens": st.none() | st.integers(1, 10**6),
        "sampling": sampling,
        "stop": st.lists(names, max_size=3).map(tuple),
        "speculative": speculative,
        "model": st.none() | model_names,
        "keep_alive": keep_alives,
    }
    return st.builds(Generate, prompt=names, messages=st.none(), **common) | st.builds(
        Generate, prompt=st.none(), messages=chat_messages.map(tuple), **common
    ) | st.builds(
        Generate, prompt=st.none(), messages=chat_messages.map(tuple), tools=tools,
        tool_choice=st.sampled_from(["auto", "none", "required"]),
        parallel_tool_calls=st.booleans(), **common)


requests: st.SearchStrategy[Any] = st.one_of(
    st.builds(Hello, id=ids, protocol_version=counts, client_name=names),
    _generate(),
    st.builds(Cancel, id=ids, ack=st.none() | ids),
    st.builds(Stats, id=ids),
    st.builds(Health, id=ids),
    st.builds(Models, id=ids),
    st.builds(Tokenize, id=ids, text=texts, add_special=st.booleans()),
    st.builds(Detokenize, id=ids, tokens=token_lists),
    st.builds(Load, id=ids, model=model_names, keep_alive=keep_alives),
    st.builds(Unload, id=ids, model=model_names),
)

responses: st.SearchStrategy[Any] = st.one_of(
    st.builds(
        Welcome,
        id=ids,
        protocol_version=counts,
        server_version=names,
        model=model_info,
        capabilities=st.lists(texts, max_size=3).map(tuple),
        proposers=st.lists(texts, max_size=3).map(tuple),
        max_frame_size=st.integers(1, 2**32),
    ),
    st.builds(Token, id=ids, text=texts, token_ids=token_lists),
    st.builds(
        Done,
        id=ids,
        finish_reason=st.sampled_from(FinishReason),
        usage=st.builds(Usage, prompt_tokens=counts, completion_tokens=counts),
        speculation=speculation_stats,
        error_message=st.none() | names,
        seed=st.none() | st.integers(0, MAX_SEED),
        model=st.none() | names,
        tool_calls=st.none() | st.lists(tool_calls, max_size=2).map(tuple),
    ),
    st.builds(ErrorMessage, id=st.none() | ids, code=st.sampled_from(ErrorCode), message=texts),
    st.builds(
        StatsReply,
        id=ids,
        uptime_s=non_negative,
        counters=st.dictionaries(texts, counter_values, max_size=3),
        proposers=st.dictionaries(texts, proposer_stats, max_size=2),
    ),
    st.builds(
        HealthReply,
        id=ids,
        status=st.sampled_from(HealthStatus),
        uptime_s=non_negative,
        active_requests=counts,
        queued_requests=counts,
    ),
    st.builds(ModelsReply, id=ids, models=st.lists(model_info, max_size=2).map(tuple)),
    st.builds(TokenizeReply, id=ids, tokens=token_lists),
    st.builds(DetokenizeReply, id=ids, text=texts),
    st.builds(CancelReply, id=ids, cancelled=st.booleans()),
    st.builds(LoadReply, id=ids, model=model_info),
    st.builds(UnloadReply, id=ids, model=model_info, unloaded=st.booleans()),
)

json_values: st.SearchStrategy[Any] = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(chars, max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=12,
)
