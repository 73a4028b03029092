"""Modelfiles (recipes.py): parsing every command, storing created models in aliases.toml
beside plain aliases (copy, delete, never a file), how a request's messages and parameters
take a recipe's, and resolve_model / the catalog serving a created model by its base."""

from __future__ import annotations

import shutil

import pytest

from tokenmill import recipes
from tokenmill.catalog import catalog
from tokenmill.recipes import Recipe, parse_modelfile
from tokenmill.resolve import resolve_model

MODELFILE = '''# a comment
FROM alpha
PARAMETER temperature 0.2
PARAMETER num_predict 3
PARAMETER stop "<|end|>"
PARAMETER stop END
SYSTEM """You are Mario.
You answer briefly."""
MESSAGE user Who are you?
MESSAGE assistant """It's-a me."""
TEMPLATE """{% for m in messages %}{{ m['content'] }}{% endfor %}"""
LICENSE MIT
'''


def test_parse_every_command() -> None:
    r = parse_modelfile("mario:latest", MODELFILE)
    assert r.name == "mario" and r.base == "alpha"
    assert r.parameters == {"temperature": 0.2, "num_predict": 3, "stop": ["<|end|>", "END"]}
    assert r.system == "You are Mario.\nYou answer briefly."
    assert r.messages == ({"role": "user", "content": "Who are you?"},
                          {"role": "assistant", "content": "It's-a me."})  # fmt: skip
    assert r.template == "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert parse_modelfile("mario", r.modelfile) == r  # its Modelfile makes it again


@pytest.mark.parametrize(
    "text, words",
    [("SYSTEM hi", "no FROM"), ("FROM a\nPARAMETER warmth 1", "unknown parameter 'warmth'"),
     ("FROM a\nPARAMETER top_k many", "top_k must be a int"),
     ("FROM a\nMESSAGE robot hi", "line 2: MESSAGE's role"),
     ('FROM a\nSYSTEM """never closed', "never closed"), ("FROM a\nADAPTER x", "ADAPTER")],
)  # fmt: skip
def test_bad_modelfiles_name_the_line(text, words) -> None:
    with pytest.raises(ValueError, match=words):
        parse_modelfile("m", text)
    with pytest.raises(ValueError, match="name"):
        parse_modelfile("bad name!", "FROM a")


def test_a_requests_messages_and_parameters_take_the_recipes() -> None:
    r = parse_modelfile("mario", MODELFILE)
    asked = [{"role": "user", "content": "hi"}]
    system, *turns, last = r.conversation(asked)
    assert system == {"role": "system", "content": r.system} and last == asked[0]
    assert [t["role"] for t in turns] == ["user", "assistant"]
    own = [{"role": "system", "content": "Be Luigi."}, *asked]
    assert r.conversation(own)[0] == own[0] and len(r.conversation(own)) == 4
    assert r.openai_defaults() == {"temperature": 0.2, "max_tokens": 3,
                                   "stop": ["<|end|>", "END"]}  # fmt: skip


def test_created_models_live_in_aliases_toml(tmp_path, tiny_model_dir, monkeypatch) -> None:
    monkeypatch.setenv("TOKENMILL_MODEL_DIR", str(tmp_path))
    shutil.copytree(tiny_model_dir("llama"), tmp_path / "alpha")
    (tmp_path / "aliases.toml").write_text(f'[aliases]\nbeta = "{tmp_path / "alpha"}"\n')
    recipes.save(parse_modelfile("mario", MODELFILE))
    recipes.copy("mario", "luigi")
    recipes.copy("alpha", "plain")  # a model made FROM another: no file is copied
    made = recipes.recipes()
    assert made["luigi"] == Recipe("luigi", *list(vars_of(made["mario"]))[1:])
    assert made["plain"].base == "alpha" and made["plain"].system is None
    assert resolve_model("mario").path == resolve_model("alpha").path  # its base's weights
    listed = {e.name: e for e in catalog(tmp_path)}
    assert listed["mario"].created and listed["mario"].path == (tmp_path / "alpha").resolve()
    assert not listed["beta"].created  # the alias, listed for its path before the directory
    recipes.delete("luigi")
    recipes.delete("beta")  # a plain alias
    assert "luigi" not in recipes.recipes() and "beta" not in recipes.recipes()
    with pytest.raises(ValueError, match="never deleted"):
        recipes.delete("alpha")  # a model's own directory: never
    assert (tmp_path / "alpha" / "config.json").exists()
    assert "mario" in (tmp_path / "aliases.toml").read_text()


def vars_of(r: Recipe) -> tuple:
    return (r.name, r.base, r.system, r.template, r.parameters, r.messages)
