"""The documents of `prepare`'s input, streamed: text files, JSON lines, parquet files
and Arrow folders written by `datasets.Dataset.save_to_disk`.

Why streamed: the corpora people download (FineWeb, The Stack) are larger than
memory; tables are read one record batch at a time with pyarrow, never whole.
Each document comes with a key that decides its split (a hash, see `corpus.is_val`)
and the input bytes it accounts for, which drive the progress bar. A table (one
parquet file, a folder of parquet files only, or a saved `datasets` folder) is one
stream of rows keyed by row number, exactly as the lines of one .jsonl file are, so
the same texts give the same token files in any of these forms.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

TEXT_SUFFIXES = (".txt", ".py", ".md")
TABLE_SUFFIXES = (".parquet",)
SUFFIXES = (*TEXT_SUFFIXES, ".jsonl", *TABLE_SUFFIXES)
DATASETS_MARKERS = ("state.json", "dataset_info.json")
BATCH_ROWS = 1024  # rows per record batch read from a table

# (split key, text, input bytes it accounts for); key None: no document, only progress
Document = tuple[str | None, str, int]


def _check_unicode(text: str, where: str, text_key: str) -> None:
    """A JSON escape can carry half of a UTF-16 pair (a lone surrogate), which is no
    character: no tokenizer can encode it, so it is named here with its place."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        char = ord(text[error.start])
        raise ValueError(
            f"{where}: field {text_key!r} holds a lone surrogate \\u{char:04x} at character "
            f"{error.start}, which is not text; fix or drop that line"
        ) from None


def _jsonl(path: Path, text_key: str, prefix: str) -> Iterator[Document]:
    """Each non-blank line of a JSON-lines file, keyed by prefix + its line index."""
    size, seen = path.stat().st_size, 0
    with path.open(encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            used = min(len(line), size - seen)
            seen += used
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise ValueError(f"{path}:{lineno} is not valid JSON") from None
            text = record.get(text_key) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise ValueError(f"{path}:{lineno} has no string field {text_key!r} (--text_key)")
            _check_unicode(text, f"{path}:{lineno}", text_key)
            yield f"{prefix}{lineno - 1}", text, used
    if size > seen:
        yield None, "", size - seen  # the rest of the file's bytes, for the progress bar


def _arrow_error(path: Path, what: str, err: Exception) -> ValueError:
    reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return ValueError(f"--input {path} is not a readable {what}: {reason}")


def _text_column(path: Path, names: list[str], types: list, text_key: str) -> None:
    """A one-line error unless the table has a string column `text_key`."""
    import pyarrow as pa

    if text_key not in names:
        raise ValueError(
            f"--input {path} has no column {text_key!r} (--text_key); its columns: "
            f"{', '.join(names) or 'none'}"
        )
    kind = types[names.index(text_key)]
    if not (
        pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)
    ):
        raise ValueError(f"--input {path}: column {text_key!r} holds {kind}, not strings")


def _texts(path: Path, batch, text_key: str, first_row: int) -> Iterator[str]:
    for offset, text in enumerate(batch.column(text_key).to_pylist()):
        if text is None:
            raise ValueError(f"{path}: row {first_row + offset} has no {text_key!r} (null)")
        yield text


def _parquet_file(path: Path, text_key: str):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise _arrow_error(path, "parquet file", err) from None
    schema = table.schema_arrow
    _text_column(path, schema.names, schema.types, text_key)
    return table


def _parquet_rows(path: Path, text_key: str, first: int) -> Iterator[Document]:
    """The rows of one parquet file, one record batch at a time, keyed from `first`."""
    import pyarrow as pa

    table = _parquet_file(path, text_key)
    size, rows = path.stat().st_size, max(1, table.metadata.num_rows)
    done = 0
    try:
        for batch in table.iter_batches(batch_size=BATCH_ROWS, columns=[text_key]):
            start = done
            for text in _texts(path, batch, text_key, start):
                done += 1
                yield str(first + done - 1), text, 0
            yield None, "", size * done // rows - size * start // rows
    except pa.ArrowException as err:
        raise _arrow_error(path, "parquet file", err) from None


def _arrow_rows(path: Path, text_key: str, first: int) -> Iterator[Document]:
    """The rows of one Arrow IPC stream file (`datasets`' format), memory-mapped."""
    import pyarrow as pa

    try:
        source = pa.memory_map(str(path))
        reader = pa.ipc.open_stream(source)
    except (pa.ArrowException, OSError) as err:
        raise _arrow_error(path, "Arrow stream file", err) from None
    _text_column(path, reader.schema.names, reader.schema.types, text_key)
    done, read = 0, 0
    try:
        for batch in reader:
            for text in _texts(path, batch, text_key, done):
                done += 1
                yield str(first + done - 1), text, 0
            yield None, "", source.tell() - read
            read = source.tell()
    except pa.ArrowException as err:
        raise _arrow_error(path, "Arrow stream file", err) from None


def _table_rows(files: list[Path], text_key: str, reader) -> Iterator[Document]:
    """The rows of several table files as one stream, numbered across them."""
    first = 0
    for path in files:
        for doc in reader(path, text_key, first):
            first += doc[0] is not None
            yield doc


def datasets_files(folder: Path) -> list[Path]:
    """The Arrow files of a folder saved by `datasets.Dataset.save_to_disk`, in order."""
    if (folder / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in folder.iterdir() if p.is_dir())
        raise ValueError(
            f"--input {folder} is a saved DatasetDict (splits: {', '.join(splits)}); give "
            f"one split's folder, e.g. {folder / (splits[0] if splits else 'train')}"
        )
    names: list[str] = []
    state = folder / "state.json"
    if state.is_file():
        try:
            listed = json.loads(state.read_text(encoding="utf-8")).get("_data_files", [])
            names = [entry["filename"] for entry in listed]
        except (ValueError, AttributeError, KeyError, TypeError):
            raise ValueError(f"--input {state} is not a datasets state.json") from None
    files = [folder / n for n in names] or sorted(folder.glob("*.arrow"))
    if not files:
        raise ValueError(f"--input {folder} is a saved datasets folder but holds no .arrow files")
    for path in files:
        if not path.is_file():
            raise ValueError(f"--input {folder}: {state.name} lists {path.name}, which is missing")
    return files


def is_datasets_folder(path: Path) -> bool:
    return path.is_dir() and any(
        (path / m).is_file() for m in (*DATASETS_MARKERS, "dataset_dict.json")
    )


def _folder_files(folder: Path) -> list[tuple[str, Path]]:
    files = sorted(
        (p.relative_to(folder).as_posix(), p)
        for p in folder.rglob("*")
        if p.suffix in SUFFIXES and p.is_file()
    )
    if not files:
        raise ValueError(f"--input {folder} holds no {'/'.join(SUFFIXES)} files")
    return files


def _mixed_folder(files: list[tuple[str, Path]], text_key: str) -> Iterator[Document]:
    for rel, path in files:
        if path.suffix == ".jsonl":
            yield from _jsonl(path, text_key, f"{rel}:")
        elif path.suffix in TABLE_SUFFIXES:
            yield from _keyed(_parquet_rows(path, text_key, 0), f"{rel}:")
        else:
            yield rel, path.read_text(encoding="utf-8", errors="replace"), path.stat().st_size


def _keyed(docs: Iterator[Document], prefix: str) -> Iterator[Document]:
    for key, text, used in docs:
        yield (None if key is None else f"{prefix}{key}"), text, used


def open_input(input_path: Path, text_key: str) -> tuple[Iterator[Document], int]:
    """The documents of `--input` (checked now: a missing column fails before anything
    is written) and the total input bytes they account for."""
    if is_datasets_folder(input_path):
        files = datasets_files(input_path)
        for path in files:  # schema of every file, before any output exists
            next(_arrow_rows(path, text_key, 0), None)
        return _table_rows(files, text_key, _arrow_rows), sum(p.stat().st_size for p in files)
    if input_path.is_dir():
        listed = _folder_files(input_path)
        files = [p for _, p in listed]
        for path in files:
            if path.suffix in TABLE_SUFFIXES:
                _parquet_file(path, text_key)
        total = sum(p.stat().st_size for p in files)
        if all(p.suffix in TABLE_SUFFIXES for p in files):  # one table cut into files
            return _table_rows(files, text_key, _parquet_rows), total
        return _mixed_folder(listed, text_key), total
    size = input_path.stat().st_size
    if input_path.suffix in TABLE_SUFFIXES:
        _parquet_file(input_path, text_key)
        return _table_rows([input_path], text_key, _parquet_rows), size
    if input_path.suffix == ".jsonl":
        return _jsonl(input_path, text_key, ""), size
    if input_path.suffix in TEXT_SUFFIXES:
        text = input_path.read_text(encoding="utf-8", errors="replace")
        return iter([(input_path.name, text, size)]), size
    raise ValueError(f"--input {input_path} is not a directory or a {'/'.join(SUFFIXES)} file")
