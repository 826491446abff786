"""The `sql` tool's database and sandbox: deterministic bytes, and hostile queries refused or cut off in time."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest

from miniverl.engine.tasks import sql_db as D

NORMAL = "SELECT name, city FROM customers WHERE id = 1"


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    path = tmp_path_factory.mktemp("sqldb") / "shop.sqlite"
    return path, D.build_database(path)


@pytest.fixture(scope="module")
def normal_text(db: tuple[Path, str]) -> str:
    """What NORMAL must render to, read through a plain sqlite3 connection."""
    conn = sqlite3.connect(db[0])
    try:
        name, city = conn.execute(NORMAL).fetchone()
    finally:
        conn.close()
    return f"name | city\n{name} | {city}"


@pytest.fixture(scope="module")
def sandbox(db: tuple[Path, str]):
    sql = D.ReadOnlySql(db[0])
    yield sql
    sql.close()


def test_the_database_is_the_same_bytes_every_build(tmp_path: Path, db: tuple[Path, str]):
    again = D.build_database(tmp_path / "a" / "shop.sqlite")
    assert again == db[1] == D.file_sha256(db[0])
    assert D.file_sha256(tmp_path / "a" / "shop.sqlite") == again
    assert list((tmp_path / "a").iterdir()) == [tmp_path / "a" / "shop.sqlite"]  # no temp file left behind


def test_the_database_holds_the_fixed_entities(db: tuple[Path, str]):
    conn = sqlite3.connect(db[0])
    try:
        names = [r[0] for r in conn.execute("SELECT name FROM customers ORDER BY id")]
        counts = {t: conn.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in ("customers", "products", "orders")}
        years = {r[0] for r in conn.execute("SELECT DISTINCT year FROM orders")}
        dangling = conn.execute("SELECT COUNT(*) FROM orders WHERE customer_id NOT IN (SELECT id FROM customers) "
                                "OR product_id NOT IN (SELECT id FROM products)").fetchone()[0]
    finally:
        conn.close()
    assert names == list(D.CUSTOMER_NAMES) and len(set(names)) == len(names)
    assert counts == {"customers": len(D.CUSTOMER_NAMES), "products": len(D.PRODUCTS), "orders": D.ORDER_COUNT}
    assert years == set(D.YEARS) and dangling == 0


def test_the_cached_copy_is_built_once_and_rebuilt_when_changed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("MINIVERL_CACHE", str(tmp_path / "cache"))
    path = D.database_path()
    assert path.parent == tmp_path / "cache" and D.file_sha256(path) == D.expected_sha256()
    built_at = path.stat().st_mtime_ns
    assert D.database_path() == path and path.stat().st_mtime_ns == built_at  # a good copy is reused
    path.chmod(0o644)
    path.write_bytes(b"tampered")
    assert D.file_sha256(D.database_path()) == D.expected_sha256()


def test_a_normal_query_renders_compactly(sandbox: D.ReadOnlySql, db: tuple[Path, str], normal_text: str):
    assert sandbox.run(NORMAL) == D.ToolResult(normal_text, True)
    conn = sqlite3.connect(db[0])
    name, price = conn.execute("SELECT name, price FROM products WHERE id = 1").fetchone()
    conn.close()
    result = sandbox.run("SELECT name, price, 12.0, 1.0/3, NULL, 1e300 FROM products WHERE id = 1")
    assert result.ok and result.text.split("\n")[0] == "name | price | 12.0 | 1.0/3 | NULL | 1e300"
    cells = result.text.split("\n")[1].split(" | ")
    assert cells[0] == name and float(cells[1]) == price and not cells[1].endswith("0")
    assert cells[2:] == ["12", "0.33", "NULL", "1e+300"]
    assert sandbox.run("SELECT name FROM customers WHERE name = 'Nobody'") == D.ToolResult("name\n(no rows)", True)


def test_rows_and_bytes_are_capped(sandbox: D.ReadOnlySql):
    rows = sandbox.run("SELECT id FROM orders ORDER BY id")
    lines = rows.text.split("\n")
    assert rows.ok and lines[:3] == ["id", "1", "2"] and len(lines) == 1 + D.MAX_ROWS + 1
    assert lines[-1].startswith("(truncated") and lines[-2] == str(D.MAX_ROWS)
    wide = sandbox.run("SELECT printf('%.*c', 60000, 'x')")
    assert wide.ok and wide.text.endswith(f"(truncated: output over {D.MAX_OUTPUT_BYTES} bytes)")
    assert len(wide.text.encode()) <= D.MAX_OUTPUT_BYTES + 100


DENIED, BUDGET, TOO_BIG = "not allowed", "ran past its budget", "too big"
# (query, the reason the model must read): the reason names the layer that stopped it, so a layer that
# stops working fails its test even where another layer (the read-only file) would still have caught it.
HOSTILE = [
    ("DROP TABLE customers", DENIED),
    ("DELETE FROM orders", DENIED),
    ("INSERT INTO customers VALUES (99, 'Mallory', 'Nowhere')", DENIED),
    ("UPDATE products SET price = 0", DENIED),
    ("CREATE TABLE t (x)", DENIED),
    ("CREATE TEMP TABLE t (x)", DENIED),
    ("ALTER TABLE customers ADD COLUMN y", DENIED),
    ("ATTACH DATABASE '{tmp}/x.db' AS x", DENIED),
    ("VACUUM INTO '{tmp}/copy.db'", DENIED),
    ("PRAGMA writable_schema=1", DENIED),
    ("SELECT * FROM pragma_table_info('customers')", DENIED),
    ("BEGIN", DENIED),
    ("SELECT load_extension('x')", DENIED),
    ("SELECT fts3_tokenizer('simple')", DENIED),
    ("SELECT 1; DROP TABLE customers", "only one statement"),
    ("REINDEX", "only SELECT queries"),
    ("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c) SELECT count(*) FROM c", BUDGET),
    ("SELECT count(*) FROM orders a, orders b, orders c, orders d", BUDGET),
    ("SELECT count(*) FROM (SELECT * FROM orders a, orders b, orders c ORDER BY random())", BUDGET),
    ("SELECT zeroblob(1000000)", TOO_BIG),
    ("SELECT replace(printf('%.*c', 60000, 'x'), 'x', 'yy')", TOO_BIG),
    ("SELECT 1 WHERE 'a' LIKE '" + "%a" * 200 + "'", "too complex"),
    ("SELECT " + "1+" * 3000 + "1", "longer than 4096 bytes"),
    ("", "empty"),
]


@pytest.mark.parametrize("query,reason", HOSTILE, ids=[q[:40] or "empty" for q, _ in HOSTILE])
def test_hostile_sql_is_refused_in_time(sandbox: D.ReadOnlySql, db: tuple[Path, str], normal_text: str,
                                        tmp_path: Path, query: str, reason: str):
    query = query.replace("{tmp}", str(tmp_path))
    start = time.perf_counter()
    result = sandbox.run(query)
    assert time.perf_counter() - start < 2.0
    assert not result.ok and result.text.startswith("error: ") and reason in result.text
    assert len(result.text) < 300
    assert D.file_sha256(db[0]) == db[1] and list(tmp_path.iterdir()) == []
    assert sandbox.run(NORMAL) == D.ToolResult(normal_text, True)


@pytest.mark.parametrize("query", ["SELECT printf('%.*c', 1000000, 'x')", "SELECT randomblob(60000)"])
def test_a_huge_value_never_comes_back_whole(sandbox: D.ReadOnlySql, db: tuple[Path, str], normal_text: str,
                                             query: str):
    start = time.perf_counter()
    result = sandbox.run(query)
    assert time.perf_counter() - start < 2.0
    assert len(result.text.encode()) <= D.MAX_OUTPUT_BYTES + 100
    assert D.file_sha256(db[0]) == db[1] and sandbox.run(NORMAL) == D.ToolResult(normal_text, True)


def test_budget_errors_name_the_budget(sandbox: D.ReadOnlySql):
    result = sandbox.run("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c) SELECT count(*) FROM c")
    assert result.text == f"error: the query ran past its budget ({D.MAX_VM_STEPS} steps or {D.MAX_SECONDS} s) and was stopped"
    assert sandbox.run("SELECT x FROM nowhere") == D.ToolResult("error: no such table: nowhere", False)
    # A bounded recursive CTE is a legitimate query and still runs.
    assert sandbox.run("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c WHERE x < 5) "
                       "SELECT sum(x) FROM c").text.endswith("\n15")


def test_the_file_is_opened_read_only(db: tuple[Path, str]):
    sql = D.ReadOnlySql(db[0])
    try:
        assert sql.run("SELECT 1").ok
        conn = sql._connection()
        with pytest.raises(sqlite3.DatabaseError):
            conn.set_authorizer(None)  # even without the authorizer, the connection cannot write
            conn.execute("DELETE FROM orders")
    finally:
        sql.close()
    assert D.file_sha256(db[0]) == db[1]
