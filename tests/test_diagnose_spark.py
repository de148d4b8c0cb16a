"""The diagnosis' queries as Spark SQL over the columnar index's Parquet dataset (pyspark in
local mode): the same findings as DuckDB's for the kinds Spark runs."""
from __future__ import annotations

import shutil

import pytest
from test_diagnose import write_capture

from tensor_viz import diagnose_spark
from tensor_viz.diagnose import diagnose, open_index

pyspark = pytest.importorskip("pyspark", reason="pyspark not installed (pip install pyspark; "
                              ".ci/run installs it)")
if shutil.which("java") is None:
    pytest.skip("no Java runtime (apt-get install default-jre-headless; .ci/run installs it)",
                allow_module_level=True)


@pytest.fixture(scope="module")
def spark():
    from pyspark.sql import SparkSession

    session = (SparkSession.builder.master("local[1]").appName("lowp-diagnose-test")
               .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "2")
               .config("spark.driver.memory", "512m").getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


def test_spark_sql_over_the_parquet_dataset_finds_what_duckdb_finds(tmp_path, spark):
    def change(rec):
        if rec["iteration"] == 3 and rec["rank"] == 1 and rec["sample_idx"] == 1 and \
                rec["operation"] == "backward":
            rec["stats"]["nan_count"] = 2                      # born in a backward, on rank 1
        if rec["module_path"] == "decoder.layers.0.mlp.linear_fc1" and rec["tensor_name"] == "weight":
            rec["stats"]["absmax"] = 0.5 * 4.0 ** rec["iteration"]
        return rec

    cap = write_capture(tmp_path / "cap", ranks=2, change=change)
    _, state = open_index(cap)                                 # DuckDB builds the dataset
    duck = [f.to_dict() for f in diagnose(cap).findings if f.kind in diagnose_spark.spark_kinds()]
    result = diagnose_spark.diagnose_parquet(spark, state.data_dir)
    assert result.records == state.records == 400
    assert set(result.checked) == set(diagnose_spark.spark_kinds())
    got = [f.to_dict() for f in result.findings]
    assert [f["kind"] for f in got] == ["range_drift", "first_nonfinite"] == [f["kind"] for f in duck]
    assert got == duck
    assert (got[1]["rank"], got[1]["iteration"], got[1]["operation"]) == (1, 3, "backward")
