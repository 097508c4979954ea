from openaligner.cli.main import main, split_config_args


def test_split_config_args():
    assert split_config_args(["a.yaml", "x=1"]) == ("a.yaml", ["x=1"])
    assert split_config_args(["x=1", "y=2"]) == (None, ["x=1", "y=2"])
    assert split_config_args([]) == (None, [])


def test_print_config_and_bad_override(capsys):
    assert main(["demo", "--print-config", "ppo_steps=4"]) == 0
    assert "ppo_steps: 4" in capsys.readouterr().out
    assert main(["demo", "no_such_key=1"]) == 2
    assert "no_such_key" in capsys.readouterr().err


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out
