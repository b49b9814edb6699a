"""The agent loop's OpenTelemetry spans and metrics, collected in memory and printed.

Needs ``pip install 'fsm-toolcalls[openai,otel]' opentelemetry-sdk``. Offline: run
``fsm replay`` in another terminal and paste the ``export`` lines it prints into this one;
then ``python opentelemetry_agent.py``. In a service, give the providers your exporters instead
(OTLP, the console).
"""

from openai import OpenAI
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from fsm.agent import run_agent_loop
from fsm.store import ConversationStore

spans = InMemorySpanExporter()
tracer_provider = TracerProvider()
tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
trace.set_tracer_provider(tracer_provider)
reader = InMemoryMetricReader()
metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


with ConversationStore("sqlite:///chat.db", auto_upgrade=True) as store:
    result = run_agent_loop(
        OpenAI(),
        store,
        store.create_conversation(),
        {"add": add, "multiply": multiply},
        model="gpt-4o-mini",
        messages=[{"role": "user", "content": "What is 1234 + 5678 and 12 * 34?"}],
    )
print(result.status, result.content)

for span in spans.get_finished_spans():  # children first: the chat spans, then invoke_agent
    attributes = span.attributes or {}
    usage = {k: v for k, v in attributes.items() if k.startswith("gen_ai.usage.")}
    print(span.name, attributes.get("gen_ai.provider.name", ""), usage or "")

data = reader.get_metrics_data()
assert data is not None
for resource in data.resource_metrics:
    for scope in resource.scope_metrics:
        for metric in scope.metrics:
            for point in metric.data.data_points:
                value = getattr(point, "sum", getattr(point, "value", None))  # histogram, counter
                print(metric.name, dict(point.attributes or {}), value)
