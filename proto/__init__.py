"""rota's protocol definitions and the command that turns them into Python."""
