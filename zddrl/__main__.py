from zddrl.cli import main

main()
