package main

// The gpushare node, as the plugin reaches it: `gpushare ctl` on its admin socket
// (the one client of the admin protocol, so its checks and errors are the node's own).

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os/exec"
	"strconv"
	"strings"

	"k8s.io/apimachinery/pkg/types"
)

// gpu is one entry of `gpushare ctl status --json`'s "gpus" (docs/contract.md).
type gpu struct {
	Index       int       `json:"index"`
	Name        string    `json:"name"`
	UUID        string    `json:"uuid"`
	Simulated   bool      `json:"simulated"`
	MemoryBytes int64     `json:"memory_bytes"`
	Sessions    []session `json:"sessions"`
}

// session is the part of a status session a claim's status shows.
type session struct {
	ID            int    `json:"id"`
	Claim         string `json:"claim"`
	State         string `json:"state"`
	ResidentBytes int64  `json:"resident_bytes"`
	SwappedBytes  int64  `json:"swapped_bytes"`
}

type status struct {
	Node struct {
		Started float64 `json:"started"` // another figure: the node started again
	} `json:"node"`
	GPUs    []gpu  `json:"gpus"`
	Version string `json:"-"` // the node's gpushare version (`gpushare --version`)
}

// prepared is a claim as the plugin told the node, kept in its CDI spec's annotation
// so that a plugin started again can tell a node started again.
type prepared struct {
	UID           types.UID `json:"uid"`
	Namespace     string    `json:"namespace"`
	Name          string    `json:"name"`
	GPU           int       `json:"gpu"`
	Pods          []string  `json:"pods"`
	MemoryRequest int64     `json:"memoryRequest"`
	MemoryLimit   int64     `json:"memoryLimit"`
	Weight        float64   `json:"weight,omitempty"`
	ComputeLimit  float64   `json:"computeLimit,omitempty"` // in (0, 1]; 0: none
	// the allocated device, as the claim's status.devices names it
	Pool    string `json:"pool"`
	Device  string `json:"device"`
	ShareID string `json:"shareID,omitempty"`
}

// node is what the driver asks of the gpushare node.
type node interface {
	prepare(p prepared) error
	unprepare(uid types.UID) error
}

type nodeCtl struct {
	ctl   []string // the gpushare command, words
	admin string   // its admin socket
}

// run is `gpushare ctl --socket ADMIN ARGS...`: its stdout, or its one-line error.
func (n nodeCtl) run(args ...string) ([]byte, error) {
	full := append(append(n.ctl[1:len(n.ctl):len(n.ctl)], "ctl", "--socket", n.admin), args...)
	var stderr bytes.Buffer
	cmd := exec.Command(n.ctl[0], full...)
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		if line := strings.TrimSpace(stderr.String()); line != "" {
			return nil, fmt.Errorf("gpushare ctl %s: %s", args[0], line)
		}
		return nil, fmt.Errorf("gpushare ctl %s: %w", args[0], err)
	}
	return out, nil
}

// status asks the node what GPUs it serves and who is on them: the driver
// publishes only what the node reports.
func (n nodeCtl) status() (status, error) {
	var st status
	out, err := n.run("status", "--json")
	if err != nil {
		return st, err
	}
	if err := json.Unmarshal(out, &st); err != nil {
		return st, fmt.Errorf("gpushare ctl status --json: %w", err)
	}
	out, err = exec.Command(n.ctl[0], append(n.ctl[1:len(n.ctl):len(n.ctl)], "--version")...).Output()
	if err != nil {
		return st, fmt.Errorf("gpushare --version: %w", err)
	}
	st.Version = strings.TrimPrefix(strings.TrimSpace(string(out)), "gpushare ")
	return st, nil
}

func (n nodeCtl) prepare(p prepared) error {
	args := []string{
		"claim", "prepare", string(p.UID), "--gpu", strconv.Itoa(p.GPU),
		"--namespace", p.Namespace, "--name", p.Name,
		"--memory-request", strconv.FormatInt(p.MemoryRequest, 10),
		"--memory-limit", strconv.FormatInt(p.MemoryLimit, 10),
	}
	if p.Weight > 0 {
		args = append(args, "--weight", strconv.FormatFloat(p.Weight, 'g', -1, 64))
	}
	if p.ComputeLimit > 0 {
		args = append(args, "--compute-limit", strconv.FormatFloat(p.ComputeLimit, 'g', -1, 64))
	}
	for _, pod := range p.Pods {
		args = append(args, "--pod", pod)
	}
	_, err := n.run(args...)
	return err
}

func (n nodeCtl) unprepare(uid types.UID) error {
	_, err := n.run("claim", "unprepare", string(uid))
	return err
}
