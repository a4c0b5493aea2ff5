from engine.generate import main


def test_cli_streams_a_completion(capsys):
    assert main(["--model", "tiny-random", "--prompt", "Hello", "--max-tokens", "5", "--no-chat"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() and "5 tokens" in captured.err


def test_cli_reports_bad_input(capsys):
    assert main(["--model", "tiny-random", "--prompt", "Hello", "--max-tokens", "0"]) == 2
    assert "max_tokens must be an integer >= 1" in capsys.readouterr().err
