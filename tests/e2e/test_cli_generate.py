"""`nanoserve generate`: prompts from arguments and from a file, through the real processes."""
import json
import os
import subprocess
import sys



REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def nanoserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scheduler_svc.entrypoints.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=600)


def test_generate_answers_a_chat_prompt_and_reads_a_prompts_file(embedded_model, tmp_path):
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("Say hello.\n\nName a color.\n")
    done = nanoserve("generate", "--model", embedded_model, "--chat", "--json", "--no-progress", "--max-tokens", "12",
                     "--prompts-file", str(prompts_file), "What is the capital of France?")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r["prompt"] for r in rows] == ["What is the capital of France?", "Say hello.", "Name a color."]
    assert rows[0]["text"].startswith("The capital of France is Paris")
    assert all(0 < len(r["token_ids"]) <= 12 and r["finish_reason"] in ("stop", "length") for r in rows)
    beams = nanoserve("generate", "--model", embedded_model, "--chat", "--json", "--no-progress", "--max-tokens", "12",
                      "--beam-width", "3", "--n", "2", "What is the capital of France?")
    assert beams.returncode == 0, beams.stderr[-3000:]
    rows = [json.loads(line) for line in beams.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 2 and rows[0]["text"].startswith("The capital of France is Paris")
    assert rows[0]["token_ids"] != rows[1]["token_ids"]


def test_generate_rejects_bad_sampling_flags_before_starting_the_engine(embedded_model):
    done = nanoserve("generate", "--model", embedded_model, "--temperature", "-1", "hi")
    assert done.returncode == 2 and "temperature must be >= 0" in done.stderr
    done = nanoserve("generate", "--model", embedded_model, "--beam-width", "2", "--n", "3", "hi")
    assert done.returncode == 2 and "n (3) must be <= beam_width (2)" in done.stderr


def test_generate_without_prompts_says_how_to_give_them(embedded_model):
    done = nanoserve("generate", "--model", embedded_model)
    assert done.returncode == 2 and "--prompts-file" in done.stderr


def test_generate_follows_a_json_schema_file(embedded_model, tmp_path):
    import jsonschema

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "legs": {"type": "integer", "minimum": 0, "maximum": 8}},
              "required": ["name", "legs"], "additionalProperties": False}
    schema_file = tmp_path / "cat.schema.json"
    schema_file.write_text(json.dumps(schema))
    done = nanoserve("generate", "--model", embedded_model, "--chat", "--json", "--no-progress", "--max-tokens", "40",
                     "--json-schema", str(schema_file), "Describe a cat as JSON.")
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert row["finish_reason"] == "stop"
    jsonschema.validate(json.loads(row["text"]), schema)


def test_generate_rejects_a_bad_constraint_before_starting_the_engine(embedded_model, tmp_path):
    done = nanoserve("generate", "--model", embedded_model, "--regex", "[a-", "hi")
    assert done.returncode == 2 and "sampling.regex: " in done.stderr and "unclosed character class" in done.stderr
    done = nanoserve("generate", "--model", embedded_model, "--regex", "a+", "--choice", "yes", "hi")
    assert done.returncode == 2 and "not allowed with argument" in done.stderr
    done = nanoserve("generate", "--model", embedded_model, "--json-schema", str(tmp_path / "missing.json"), "hi")
    assert done.returncode == 2 and "cannot read" in done.stderr
