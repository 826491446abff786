"""The `sql` task's database, and the sandbox that runs model-written queries on it.

The database is a small shop (customers, products, orders) generated from a
fixed seed, so its bytes are the same on every build with one SQLite version;
`database_path` keeps a cached copy and rebuilds it whenever its sha256 differs
from a fresh build's.

Model output is hostile input. `ReadOnlySql` opens the file read-only and lets
SQLite itself refuse what is not a plain read: an authorizer allows only
SELECT, table reads, recursive CTEs and non-dangerous functions; limits cap the
query text, value sizes and compound selects; a progress handler stops a query
past a VM-step budget or a wall-clock budget (whichever comes first, so a slow
machine still stops in time and a fast one stops at the same step count). Every
failure becomes an error text the model reads; nothing here raises.
"""

from __future__ import annotations

import functools
import hashlib
import os
import random
import sqlite3
import tempfile
import threading
import time
from pathlib import Path

from miniverl.engine.tasks.base import ToolResult

DB_FILENAME = "sql-db-v1.sqlite"
CUSTOMER_NAMES = (
    "Alice", "Bruno", "Chloe", "Diego", "Emma", "Farid", "Greta", "Hugo", "Ines", "Jonas",
    "Kira", "Liam", "Maya", "Nico", "Olga", "Pablo", "Quinn", "Rosa", "Sami", "Tara",
    "Umar", "Vera", "Wes", "Xenia", "Yusuf", "Zoe", "Aaron", "Bella", "Carlos", "Dana",
    "Elias", "Fiona", "Gavin", "Hana", "Ivan", "Julia", "Karl", "Lena", "Marco", "Nora",
)
CITIES = ("Paris", "Berlin", "Madrid", "Rome", "Vienna", "Lisbon", "Prague", "Oslo")
CATEGORIES = ("Home", "Office", "Kitchen", "Garden")
PRODUCTS = (  # (name, category)
    ("Lamp", "Home"), ("Rug", "Home"), ("Pillow", "Home"), ("Mirror", "Home"), ("Clock", "Home"),
    ("Chair", "Office"), ("Desk", "Office"), ("Stapler", "Office"), ("Monitor", "Office"), ("Notebook", "Office"),
    ("Kettle", "Kitchen"), ("Toaster", "Kitchen"), ("Blender", "Kitchen"), ("Pan", "Kitchen"), ("Mug", "Kitchen"),
    ("Shovel", "Garden"), ("Hose", "Garden"), ("Rake", "Garden"), ("Planter", "Garden"), ("Lantern", "Garden"),
)
YEARS = (2021, 2022, 2023, 2024)
ORDER_COUNT = 400

SCHEMA_TEXT = ("Tables: customers(id, name, city); products(id, name, category, price); "
               "orders(id, customer_id, product_id, quantity, year).")

# What one query may cost. The step budget is the deterministic bound; the wall clock is the backstop.
MAX_QUERY_BYTES = 4096
MAX_VALUE_BYTES = 64 * 1024
MAX_ROWS = 20
MAX_OUTPUT_BYTES = 2048
MAX_VM_STEPS = 5_000_000
MAX_SECONDS = 0.5
PROGRESS_EVERY = 1000  # VM instructions between progress-handler calls
HEAP_LIMIT_BYTES = 256 * 1024 * 1024  # process-wide in SQLite: generous so it only stops a runaway
# Functions that reach outside the database or hand out pointers; the rest of SQLite's built-ins are pure.
DENIED_FUNCTIONS = frozenset({"load_extension", "fts3_tokenizer", "readfile", "writefile", "edit", "fts5"})
ALLOWED_ACTIONS = frozenset({sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION,
                             sqlite3.SQLITE_RECURSIVE})


def _rows() -> tuple[list[tuple], list[tuple], list[tuple]]:
    """Every row of the three tables; the only source of randomness is the fixed seed."""
    rng = random.Random("sql-db/v1")
    customers = [(i + 1, name, rng.choice(CITIES)) for i, name in enumerate(CUSTOMER_NAMES)]
    # Prices in whole cents, so a stored float prints back exactly at two decimals.
    products = [(i + 1, name, category, rng.randrange(199, 25000) / 100) for i, (name, category) in enumerate(PRODUCTS)]
    orders = [(i + 1, rng.randint(1, len(customers)), rng.randint(1, len(products)), rng.randint(1, 5),
               rng.choice(YEARS)) for i in range(ORDER_COUNT)]
    return customers, products, orders


def build_database(path: Path) -> str:
    """Write the database to `path` atomically (read-only file mode) and return its sha256."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=".sql-db-", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        customers, products, orders = _rows()
        conn = sqlite3.connect(tmp, isolation_level=None)
        try:
            conn.execute("BEGIN")
            conn.execute("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT NOT NULL, city TEXT NOT NULL)")
            conn.execute("CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT NOT NULL, "
                         "category TEXT NOT NULL, price REAL NOT NULL)")
            conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER NOT NULL "
                         "REFERENCES customers(id), product_id INTEGER NOT NULL REFERENCES products(id), "
                         "quantity INTEGER NOT NULL, year INTEGER NOT NULL)")
            conn.executemany("INSERT INTO customers VALUES (?, ?, ?)", customers)
            conn.executemany("INSERT INTO products VALUES (?, ?, ?, ?)", products)
            conn.executemany("INSERT INTO orders VALUES (?, ?, ?, ?, ?)", orders)
            conn.execute("COMMIT")
        finally:
            conn.close()
        digest = file_sha256(tmp)
        os.chmod(tmp, 0o444)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return digest


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@functools.cache
def expected_sha256() -> str:
    """A fresh build's digest, once per process: it depends on the SQLite version, so it is never hard-coded."""
    with tempfile.TemporaryDirectory(prefix="miniverl-sql-") as tmp:
        return build_database(Path(tmp) / DB_FILENAME)


def cache_dir() -> Path:
    return Path(os.environ.get("MINIVERL_CACHE") or Path.home() / ".cache" / "miniverl")


def database_path() -> Path:
    """The cached database, built on first use and rebuilt when it is not the expected bytes.

    A cache directory that cannot be written (a read-only home, say) falls back to one under
    the system's temporary directory rather than failing the run.
    """
    for directory in (cache_dir(), Path(tempfile.gettempdir()) / f"miniverl-{os.getuid()}"):
        path = directory / DB_FILENAME
        try:
            if not path.is_file() or file_sha256(path) != expected_sha256():
                build_database(path)
            return path
        except OSError:
            continue
    raise OSError(f"cannot write the sql task's database under {cache_dir()} or the temporary directory")


def read_only_uri(path: Path) -> str:
    return f"{path.resolve().as_uri()}?mode=ro"


def render_value(value: object) -> str:
    """One cell as the model reads it; floats lose their binary noise (12.5, not 12.499999999)."""
    if value is None:
        return "NULL"
    if isinstance(value, float):
        if abs(value) >= 1e15:  # past this, two decimals would print every digit of the binary value
            return f"{value:.15g}"
        text = f"{value:.2f}"
        text = text.rstrip("0").rstrip(".") if "." in text else text
        return "0" if text == "-0" else text
    if isinstance(value, bytes):
        return f"<blob of {len(value)} bytes>"
    return str(value).replace("\r", "\\r").replace("\n", "\\n")


def _cut(text: str, limit: int) -> str:
    """`text` cut to at most `limit` UTF-8 bytes, never mid-character."""
    return text.encode()[:limit].decode(errors="ignore")


class ReadOnlySql:
    """Runs one model-written query at a time on a read-only connection; opened on first use.

    `path` None means the cached database (`database_path`), found or built on the first query.
    """

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self._conn: sqlite3.Connection | None = None
        self._lock = threading.Lock()  # the progress handler's budget is per connection, so one query at a time
        self._steps = 0
        self._deadline = 0.0

    def run(self, query: str) -> ToolResult:
        with self._lock:
            try:
                return self._run(query)
            except Exception as exc:  # every failure is shown to the model, never raised
                return ToolResult(f"error: {_reason(exc)}", False)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def _run(self, query: str) -> ToolResult:
        if not query.strip():
            return ToolResult("error: the query is empty", False)
        if len(query.encode()) > MAX_QUERY_BYTES:
            return ToolResult(f"error: the query is longer than {MAX_QUERY_BYTES} bytes", False)
        conn = self._connection()
        self._steps, self._deadline = 0, time.monotonic() + MAX_SECONDS
        cursor = conn.execute(query)  # refuses a second statement itself
        try:
            if cursor.description is None:  # e.g. REINDEX: read-only and harmless, but not a query
                return ToolResult("error: only SELECT queries can run", False)
            return ToolResult(self._render(cursor), True)
        finally:
            cursor.close()

    def _render(self, cursor: sqlite3.Cursor) -> str:
        lines = [" | ".join(render_value(d[0]) for d in cursor.description or ())]
        size, note = len(lines[0].encode()), None
        # Rows are fetched one at a time, so a huge result is never held whole.
        while (row := cursor.fetchone()) is not None:
            if len(lines) > MAX_ROWS:
                note = f"(truncated: more than {MAX_ROWS} rows)"
                break
            lines.append(" | ".join(render_value(v) for v in row))
            size += 1 + len(lines[-1].encode())
            if size > MAX_OUTPUT_BYTES:
                note = f"(truncated: output over {MAX_OUTPUT_BYTES} bytes)"
                break
        if len(lines) == 1:
            lines.append("(no rows)")
        text = "\n".join(lines)
        if note is None and len(text.encode()) > MAX_OUTPUT_BYTES:  # a header alone can be that long
            note = f"(truncated: output over {MAX_OUTPUT_BYTES} bytes)"
        return f"{_cut(text, MAX_OUTPUT_BYTES)}\n{note}" if note else text

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            conn = sqlite3.connect(read_only_uri(self.path or database_path()), uri=True,
                                   check_same_thread=False, isolation_level=None)
            _harden(conn)
            conn.set_progress_handler(self._progress, PROGRESS_EVERY)
            self._conn = conn
        return self._conn

    def _progress(self) -> int:
        """Non-zero aborts the running statement (SQLite reports it as 'interrupted')."""
        self._steps += PROGRESS_EVERY
        return int(self._steps > MAX_VM_STEPS or time.monotonic() > self._deadline)


def _harden(conn: sqlite3.Connection) -> None:
    """Limits and pragmas first (the authorizer would refuse our own PRAGMAs), then the authorizer."""
    if hasattr(conn, "enable_load_extension"):
        conn.enable_load_extension(False)
    if hasattr(conn, "setlimit"):  # Python 3.11+
        for limit, value in ((sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES),
                             (sqlite3.SQLITE_LIMIT_SQL_LENGTH, MAX_QUERY_BYTES),
                             (sqlite3.SQLITE_LIMIT_COLUMN, 64),
                             (sqlite3.SQLITE_LIMIT_EXPR_DEPTH, 100),
                             (sqlite3.SQLITE_LIMIT_COMPOUND_SELECT, 20),
                             (sqlite3.SQLITE_LIMIT_FUNCTION_ARG, 16),
                             (sqlite3.SQLITE_LIMIT_ATTACHED, 0),
                             (sqlite3.SQLITE_LIMIT_LIKE_PATTERN_LENGTH, 200),
                             (sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 0),
                             (sqlite3.SQLITE_LIMIT_TRIGGER_DEPTH, 0)):
            conn.setlimit(limit, value)
    conn.execute("PRAGMA query_only = 1")
    # The heap limit is process-wide, so only ever lower it, never loosen one someone else set.
    (current,) = conn.execute("PRAGMA hard_heap_limit").fetchone()
    if current == 0 or current > HEAP_LIMIT_BYTES:
        conn.execute(f"PRAGMA hard_heap_limit = {HEAP_LIMIT_BYTES}")
    conn.set_authorizer(_authorize)


def _authorize(action: int, arg1: str | None, arg2: str | None, _db: str | None, _trigger: str | None) -> int:
    if action not in ALLOWED_ACTIONS:
        return sqlite3.SQLITE_DENY
    if action == sqlite3.SQLITE_FUNCTION and (arg2 or "").lower() in DENIED_FUNCTIONS:
        return sqlite3.SQLITE_DENY
    return sqlite3.SQLITE_OK


def _reason(exc: Exception) -> str:
    """A short reason for the model: what went wrong, not where."""
    message = str(exc)
    if "interrupted" in message:
        return f"the query ran past its budget ({MAX_VM_STEPS} steps or {MAX_SECONDS} s) and was stopped"
    if "not authorized" in message or "authorization denied" in message:
        return "not allowed: only read-only SELECT queries on the shop tables can run"
    if "one statement at a time" in message:
        return "only one statement per query"
    if isinstance(exc, MemoryError) or "out of memory" in message:
        return "the query used too much memory"
    return _cut(message or type(exc).__name__, 200)
