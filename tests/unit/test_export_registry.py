"""The exporter registry: each algorithm finds its exporter; engine configs find their reader."""
import pytest

from deepspec.drafts import available_drafters
from deepspec.export.eagle3 import Eagle3Exporter
from deepspec.export.errors import ExportUnsupported
from deepspec.export.parallel import ParallelExporter
from deepspec.export.registry import exporter_for, exporters, reader_of, register_exporter
from deepspec.export.schemas import SCHEMAS


def test_every_builtin_drafter_has_its_exporter():
    builtin = {"dflash", "dspark", "eagle3"}          # tests may register their own drafters too
    assert builtin <= set(available_drafters())
    assert {n: type(exporter_for(n)) for n in builtin} == {
        "dflash": ParallelExporter, "dspark": ParallelExporter, "eagle3": Eagle3Exporter}
    assert [type(e) for e in exporters()].count(ParallelExporter) == 1       # one instance for both names
    assert {"speculators_dspark", "sglang_dspark", "speculators_eagle3", "sglang_eagle3"} <= set(SCHEMAS)


def test_an_algorithm_without_exporter_is_refused_for_the_engines():
    with pytest.raises(ExportUnsupported, match="no SGLang layout is known for draft algorithm 'medusa'"):
        exporter_for("medusa").analyze("sglang", "medusa", {}, [])


@pytest.mark.parametrize("fmt, cfg, reader", [
    ("vllm", {"speculators_model_type": "dspark"}, ParallelExporter),
    ("vllm", {"speculators_model_type": "dflash"}, ParallelExporter),
    ("vllm", {"speculators_model_type": "eagle3"}, Eagle3Exporter),
    ("sglang", {"dflash_config": {}}, ParallelExporter),
    ("sglang", {"architectures": ["LlamaForCausalLMEagle3"]}, Eagle3Exporter),
    ("vllm", {"speculators_model_type": "medusa"}, type(None)),
    ("sglang", {"architectures": ["Qwen3ForCausalLM"]}, type(None)),
])
def test_engine_configs_find_their_reader(fmt, cfg, reader):
    assert type(reader_of(fmt, cfg)) is reader


def test_register_exporter_takes_exporter_classes_only():
    with pytest.raises(TypeError, match="Exporter subclass"):
        register_exporter("medusa")(object)
