from dlrmflow.cli import main

main()
