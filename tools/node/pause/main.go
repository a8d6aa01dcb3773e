// Command pause is the sandbox ("pause") container of the test node's pods: it holds the pod's
// namespaces, reaps the orphans that end up as its children (it is PID 1 of the pod's PID
// namespace when the pod shares one), and exits on SIGINT or SIGTERM, as Kubernetes' own pause
// program does. Built here because no image registry is reachable; the kubelet and containerd
// are told to use the image made from it (scripts/start-node.sh).
package main

import (
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "-v" {
		fmt.Println("pause (podvolume-agent test node)")
		return
	}
	signals := make(chan os.Signal, 8)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for s := range signals {
		if s != syscall.SIGCHLD {
			os.Exit(0)
		}
		// Reap every child that has ended; WNOHANG so a live child does not block the loop.
		for {
			pid, err := syscall.Wait4(-1, nil, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
