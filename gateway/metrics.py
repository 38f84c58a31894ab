"""Prometheus metrics of one gateway (its own registry: no process-global state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from routing.admission import Admission
from routing.cache_feedback import CacheFeedback

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TBT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1)
_DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2.5e-3, 1e-2)
_ERROR_BUCKETS = (-0.5, -0.25, -0.1, -0.05, 0, 0.05, 0.1, 0.25, 0.5, 1, 2)


class GatewayMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("kvgate_requests", "Requests by outcome", ["outcome"], registry=r)
        self.model_requests = Counter(
            "kvgate_model_requests",
            "Requests by served model (config models) and outcome",
            ["model", "outcome"],
            registry=r,
        )
        self.rejections = Counter(
            "kvgate_rejections",
            "Rejections by reason and priority",
            ["reason", "priority"],
            registry=r,
        )
        self.best_effort = Counter(
            "kvgate_best_effort_admissions",
            "Requests admitted without the TTFT promise: no instance could meet the TTFT SLO "
            "even idle, and the fleet had idle capacity (admission.best_effort)",
            registry=r,
        )
        self.doomed_warmups = Counter(
            "kvgate_doomed_warmups",
            "Prompts of doomed requests turned away, prefilled for the requests that share "
            "their prefix (admission.doomed_warmup), by outcome",
            ["outcome"],
            registry=r,
        )
        self.ttft = Histogram(
            "kvgate_ttft_seconds",
            "Observed time to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tbt = Histogram(
            "kvgate_tbt_seconds",
            "Observed time between streamed chunks",
            buckets=_TBT_BUCKETS,
            registry=r,
        )
        self.ttft_error = Histogram(
            "kvgate_ttft_prediction_error_ratio",
            "(observed - predicted) / predicted TTFT",
            buckets=_ERROR_BUCKETS,
            registry=r,
        )
        self.decision = Histogram(
            "kvgate_decision_seconds",
            "Time to make one scheduling decision",
            buckets=_DECISION_BUCKETS,
            registry=r,
        )
        self.queue = Gauge(
            "kvgate_instance_queue_seconds",
            "Predicted wait of a new prefill per instance (booked prefills; on a full colocated "
            "engine, until a sequence leaves; times the learned queue scale)",
            ["instance"],
            registry=r,
        )
        self.queue_scale = Gauge(
            "kvgate_instance_queue_scale",
            "Learned factor on the books' queue waits per instance (1 = as booked)",
            ["instance"],
            registry=r,
        )
        self.batch = Gauge(
            "kvgate_instance_decode_batch", "Decode batch per instance", ["instance"], registry=r
        )
        self.tbt_headroom_share = Gauge(
            "kvgate_tbt_headroom_share",
            "Share of the priority classes' TBT headroom in force, learned from the decodes'"
            " outcomes (admission.tbt_headroom), per served model",
            ["model"],
            registry=r,
        )
        self.wait_margin = Gauge(
            "kvgate_wait_margin",
            "Factor on the predicted queue waits that admission checks, learned from the"
            " admitted requests' first tokens (admission.wait_margin), per served model",
            ["model"],
            registry=r,
        )
        self.stall_credit = Gauge(
            "kvgate_stall_credit",
            "Share of the colocated decodes' future TBT slack that a new prefill's stall may"
            " spend, learned from their outcomes (admission.prefill_stall), per served model",
            ["model"],
            registry=r,
        )
        self.decode_rebinds = Gauge(
            "kvgate_decode_rebinds",
            "Decodes moved when their prefill finished, since start (routing.decode_rebind)",
            registry=r,
        )
        self.decode_queue = Gauge(
            "kvgate_decode_queue",
            "Requests turned away on the TBT check that wait for decode room: waiting now, and"
            " admitted or expired since start (admission.decode_queue)",
            ["state"],
            registry=r,
        )
        self.decode_tbt_moves = Gauge(
            "kvgate_decode_tbt_moves",
            "Requests admitted on another decode instance than planned, whose TBT check failed,"
            " since start (routing/decode_placement.py tbt_fallback)",
            registry=r,
        )
        self.healthy = Gauge(
            "kvgate_instance_healthy", "1 if the instance takes traffic", ["instance"], registry=r
        )
        self.cache_hit = Gauge(
            "kvgate_cache_hit_ratio",
            "Share of prompt tokens placed on a prefix kvgate believed cached (answered requests)",
            registry=r,
        )
        self.replications = Counter(
            "kvgate_replication_commands",
            "Replication commands by reason and state",
            ["reason", "state"],
            registry=r,
        )
        self.replicated_bytes = Counter(
            "kvgate_replicated_bytes",
            "KV bytes copied by confirmed replication commands",
            registry=r,
        )
        self.replication_latency = Histogram(
            "kvgate_replication_confirm_seconds",
            "Issue-to-confirmation time of copies",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream_errors = Counter(
            "kvgate_upstream_errors", "Engine leg failures", ["instance"], registry=r
        )
        self.retries = Counter("kvgate_retries", "Requests retried on another instance", registry=r)
        # The cache view against the engines' own reports, over the answers that carry one.
        self.engine_cache_hit = Gauge(
            "kvgate_engine_cache_hit_ratio",
            "Share of prompt tokens the engines reported cached (answers with a report)",
            registry=r,
        )
        feedback = Counter(
            "kvgate_cache_feedback_tokens",
            "Prompt tokens of answers with an engine cache report: all, predicted cached by "
            "kvgate, reported cached by the engine (in kvgate's tokens)",
            ["kind"],
            registry=r,
        )
        self._fb_prompt = feedback.labels("prompt")
        self._fb_predicted = feedback.labels("predicted_cached")
        self._fb_engine = feedback.labels("engine_cached")
        self.view_dropped = Counter(
            "kvgate_cache_view_dropped_blocks",
            "Blocks dropped from the cache view because an engine reported them evicted",
            registry=r,
        )
        self.slot_evicted = Counter(
            "kvgate_cache_view_slot_evicted_blocks",
            "Blocks dropped from the cache view because kvgate sent a request to the llama.cpp "
            "slot that held them",
            registry=r,
        )
        self.slot_files = Counter(
            "kvgate_llamacpp_slot_files_total",
            "llama.cpp slot files (routing.llamacpp_slot_save_path, gateway/slot_files.py), by "
            "event: saved, restored, deleted, adopted (found in the directory: an earlier run's, "
            "another replica's), vanished (deleted by another replica), leftover_deleted, and "
            "save_failed / restore_failed / delete_failed",
            ["event"],
            registry=r,
        )
        self.tokenized_ahead = Counter(
            "kvgate_prompts_tokenized_ahead",
            "Long prompts given to a worker thread to tokenize (gateway/tokenize_ahead.py), by "
            "outcome: delivered; gave_up (no result within the bound) or threads_busy (one job "
            "per core out already): the loop tokenized",
            ["outcome"],
            registry=r,
        )
        self.engine_metrics_understood = Gauge(
            "kvgate_engine_metrics_understood",
            "1 if the instance's /metrics gave a load signal kvgate understands, else 0",
            ["instance"],
            registry=r,
        )
        # Tenants (config ``tenants``; gateway/tenants.py): one series per configured tenant.
        self.tenant_requests = Counter(
            "kvgate_tenant_requests",
            "Requests by tenant and outcome",
            ["tenant", "outcome"],
            registry=r,
        )
        self.tenant_prompt_tokens = Counter(
            "kvgate_tenant_prompt_tokens",
            "Prompt tokens admitted per tenant",
            ["tenant"],
            registry=r,
        )
        self.tenant_over_share = Counter(
            "kvgate_tenant_over_share_rejections",
            "Requests rejected because their tenant was over its fair share (tightened SLO)",
            ["tenant"],
            registry=r,
        )
        self.tenant_in_flight = Gauge(
            "kvgate_tenant_in_flight", "Requests in flight per tenant", ["tenant"], registry=r
        )
        self._reported_prompt = 0
        self._reported_cached = 0
        self._prompt_tokens = 0
        self._cached_tokens = 0

    def placed(self, prompt_tokens: int, cached_tokens: int) -> None:
        self._prompt_tokens += prompt_tokens
        self._cached_tokens += cached_tokens
        if self._prompt_tokens:
            self.cache_hit.set(self._cached_tokens / self._prompt_tokens)

    def cache_feedback(self, fb: CacheFeedback) -> None:
        if fb.dropped_blocks:
            self.view_dropped.inc(fb.dropped_blocks)
        if fb.engine_cached_tokens is None:
            return
        self._fb_prompt.inc(fb.prompt_tokens)
        self._fb_predicted.inc(fb.predicted_cached_tokens)
        self._fb_engine.inc(fb.engine_cached_tokens)
        self._reported_prompt += fb.prompt_tokens
        self._reported_cached += fb.engine_cached_tokens
        if self._reported_prompt:
            self.engine_cache_hit.set(self._reported_cached / self._reported_prompt)

    def publish_learned(self, admission: Admission) -> None:
        """What admission learned, per served model: the TBT headroom in force, the wait
        margin and the colocated stall credit."""
        for model, control in admission.tbt_headroom.items():
            self.tbt_headroom_share.labels(model or "").set(control.share)
        for model, margin in admission.wait_margins.items():
            self.wait_margin.labels(model or "").set(margin.factor)
        for model, credit in admission.stall_credits.items():
            self.stall_credit.labels(model or "").set(credit.credit)

    def render(self) -> bytes:
        return generate_latest(self.registry)
