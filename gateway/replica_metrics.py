"""The replica exchange's counters as Prometheus metrics, read when /metrics is scraped (a
custom collector: nothing is counted twice and the exchange's hot path is not touched)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.replica_exchange import ReplicaExchange


class ReplicaExchangeCollector(Collector):
    def __init__(self, exchange: ReplicaExchange) -> None:
        self._exchange = exchange

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        st = self._exchange.stats
        sent = CounterMetricFamily(
            "kvgate_replica_snapshots_published",
            "Snapshots of this replica's dispatched work sent to its peers, by trigger",
            labels=["trigger"],
        )
        sent.add_metric(["dispatch"], st.on_dispatch)
        sent.add_metric(["interval"], st.published - st.on_dispatch)
        yield sent
        got = CounterMetricFamily(
            "kvgate_replica_snapshots_received",
            "Peer snapshots received, by what became of them",
            labels=["result"],
        )
        got.add_metric(["applied"], st.received)
        got.add_metric(["stale"], st.stale)
        got.add_metric(["invalid"], st.invalid)
        yield got
        yield CounterMetricFamily(
            "kvgate_replica_peer_expired",
            "Peers whose share of the load was dropped after they fell silent",
            value=st.expired,
        )
        relay = self._exchange.owners
        if relay is not None:
            owners = CounterMetricFamily(
                "kvgate_replica_response_owners",
                "Responses API owners (which instance made a response) sent to the peers for "
                "the first time, and learned from them",
                labels=["direction"],
            )
            owners.add_metric(["sent"], relay.sent)
            owners.add_metric(["learned"], relay.learned)
            yield owners
        yield GaugeMetricFamily(
            "kvgate_replica_peers", "Peers heard from recently", value=len(self._exchange.peers)
        )
