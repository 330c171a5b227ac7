// Command llmd-decode decodes captured KV-event messages with llm-d's own vLLM adapter
// (github.com/llm-d/llm-d-kv-cache/pkg/kvevents/engineadapter, what its indexer runs) and
// prints what the adapter made of each one as a JSON line.
//
// Stdin: one record per message, [u32 topic length][topic][u64 seq][u32 payload length]
// [payload], integers big-endian. Stdout, per record:
// {"seq", "pod", "model", "ts", "events": [{"type", "event"}], "error"}, "event" being the
// adapter's own struct (BlockStoredEvent, BlockRemovedEvent, AllBlocksClearedEvent).
package main

import (
	"bufio"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"

	"github.com/llm-d/llm-d-kv-cache/pkg/kvevents"
	"github.com/llm-d/llm-d-kv-cache/pkg/kvevents/engineadapter"
)

type decodedEvent struct {
	Type  kvevents.EventType    `json:"type"`
	Event kvevents.GenericEvent `json:"event"`
}

type decodedMessage struct {
	Seq    uint64         `json:"seq"`
	Pod    string         `json:"pod"`
	Model  string         `json:"model"`
	TS     float64        `json:"ts"`
	Events []decodedEvent `json:"events"`
	Error  string         `json:"error,omitempty"`
}

func readFrame(r io.Reader) ([]byte, error) {
	var n uint32
	if err := binary.Read(r, binary.BigEndian, &n); err != nil {
		return nil, err
	}
	buf := make([]byte, n)
	if _, err := io.ReadFull(r, buf); err != nil {
		return nil, err
	}
	return buf, nil
}

func run(in io.Reader, out io.Writer) error {
	reader := bufio.NewReader(in)
	enc := json.NewEncoder(out)
	adapter := engineadapter.NewVLLMAdapter()
	for {
		topic, err := readFrame(reader)
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("topic: %w", err)
		}
		var seq uint64
		if err := binary.Read(reader, binary.BigEndian, &seq); err != nil {
			return fmt.Errorf("seq: %w", err)
		}
		payload, err := readFrame(reader)
		if err != nil {
			return fmt.Errorf("payload: %w", err)
		}
		msg := &kvevents.RawMessage{Topic: string(topic), Sequence: seq, Payload: payload}
		pod, model, batch, err := adapter.ParseMessage(msg)
		rec := decodedMessage{Seq: seq, Pod: pod, Model: model, TS: batch.Timestamp}
		rec.Events = make([]decodedEvent, 0, len(batch.Events))
		if err != nil {
			rec.Error = err.Error()
		}
		for _, ev := range batch.Events {
			rec.Events = append(rec.Events, decodedEvent{Type: ev.Type(), Event: ev})
		}
		if err := enc.Encode(rec); err != nil {
			return err
		}
	}
}

func main() {
	if err := run(os.Stdin, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "llmd-decode:", err)
		os.Exit(1)
	}
}
