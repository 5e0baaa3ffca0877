"""What more than one bench script needs: the work both sides of bench/vs_trl.py run (`vs_trl_work`). A script
imports these and agent_rl, never another script; nothing here imports a script (tests/test_layout.py)."""
