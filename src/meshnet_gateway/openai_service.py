"""The gateway's OpenAI service wired to its chain, and the hops it closes."""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshnet_runtime.metrics import ReadAtScrape

from .entry import last_stage_pool
from .openai import OpenAIService, ServedModel
from .openai.direct_return import DirectReturn
from .openai.draft_model import DraftModel
from .openai.generation import ChainSettings
from .openai.metrics import GenerationMetrics, ServingMetrics
from .openai.prefix_index import PrefixIndex, prefix_index_samples
from .openai.speculation import Speculate

if TYPE_CHECKING:
    from .app import GatewayApp

__all__ = ["close_hops", "openai_service"]


async def close_hops(app: GatewayApp) -> None:
    """The connections to the entry and, with --direct-return, to the last stage."""
    await app.pool.aclose()
    if app.direct is not None:
        await app.direct.aclose()


def openai_service(app: GatewayApp) -> OpenAIService:
    """The OpenAI API (/v1) over the gateway's chain: ``--model``'s tokenizer,
    the prefix index, the last stage polled directly (``--direct-return``)."""
    config = app.config
    assert config.model is not None
    model = ServedModel.load(config.model, name=config.model_name, context=config.max_context)

    prefix = None if config.no_prefix_cache else PrefixIndex()
    if prefix is not None:
        app.metrics.registry.register(ReadAtScrape(lambda: prefix_index_samples(prefix)))

    last = last_stage_pool(config, app.metrics)
    direct = app.direct = None if last is None else DirectReturn(last, app.codecs)
    speculate = None
    if config.speculate != "off":
        draft = None
        if config.draft_model is not None:  # its KV: --max-running sessions of the context
            draft = DraftModel.load(
                config.draft_model,
                vocab=model.tokenizer.vocab_size,
                sessions=config.max_running,
                context=model.context_length,
            )
        speculate = Speculate(config.speculate_max_draft, config.speculate_windows, model=draft)

    def chain_settings() -> ChainSettings:
        # Read per request: the inflight cap follows the entry's reorder window.
        return ChainSettings(
            chunk_tokens=config.chunk_tokens,
            inflight=app.inflight,
            encoding=config.encoding,
            zstd_level=config.zstd_level,
            timeout=config.timeout,
            retry=app.retry,
            stage=app.expected_entry,
            on_stage_mismatch=lambda: app.on_chain_suspect(),
            prefix=prefix,
            sample_at=config.sample_at,
            direct=direct,
            speculate=speculate,
        )

    # Prompts the chain can take as one run: no more chunks than a run may have.
    max_prompt = config.chunk_tokens * config.limits.max_chunk_total
    return OpenAIService(
        model,
        app.pool,
        app.codecs,
        chain_settings,
        max_tokens_default=config.max_tokens_default,
        max_prompt_tokens=max_prompt,
        max_prompt_chars=config.max_prompt_chars,
        max_messages=config.max_messages,
        special_tokens_in_content=config.special_tokens_in_content,
        metrics=GenerationMetrics(app.metrics.registry),
        admission=app.admission,
        spawn=app._spawn,
        serving=ServingMetrics(app.metrics.registry, model.name, model.context_length),
    )
